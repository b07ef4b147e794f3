"""FsdpUnit: one layer whose sharded weights are all-gathered for its forward, again for its backward,
and whose weight gradients are reduce-scattered into the replicas' pieces (ZeRO stage 3)."""

from __future__ import annotations

import functools
import threading

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat.captured_inputs import differentiable_captures
from tfdist.zero.collectives import ShardCollectives
from tfdist.zero.fsdp import _keras as fsdp_keras
from tfdist.zero.fsdp.param import FsdpParam, current_unit
from tfdist.zero.sliced_gradients import piece_slices, rows_of

__all__ = ["FsdpUnit"]


class FsdpUnit:
    """Wraps one layer instance's `call` (the layer keeps its class and config).

    In a replica of a training step the wrapped call is a `tf.custom_gradient` block whose inputs are
    the layer's inputs, this replica's pieces of the layer's weights and the current values of its
    other variables (moving statistics, seeds). Forward: one all-gather of the unit's pieces, the
    stock call with every weight bound to the gathered tensors (`keras.StatelessScope`), the gathered
    tensors then have no consumer left and are freed (unless `reshard_after_forward=False`, which
    keeps them for the backward instead of gathering again). Backward: all-gather again, recompute the
    forward under a GradientTape (as `tf.recompute_grad` does, so the unit's activations are not kept
    either), then one reduce-scatter of the weight gradients: each replica gets the sum over replicas
    of its own piece, the gradient of its piece variable. Updates of the other variables (BatchNorm's
    moving statistics) happen once, after the forward, as in stock Keras.

    Outside a replica (symbolic builds, eager calls in cross-replica context) the stock call runs and
    reading a weight assembles it in full.

    Example:
        >>> # zero_stage=3 on 4 replicas, Sequential([Input((8,)), Dense(16), Dense(10)]), after one fit
        >>> engine = tfdist.zero.engine_of(model)
        >>> [(u.layer.name, u.gathered_bytes) for u in engine.units]   # padded to 4 pieces, float32
        [('dense', 576), ('dense_1', 688)]
    """

    def __init__(self, layer, params: list[tuple[keras.Variable, FsdpParam]], comm: ShardCollectives,
                 reshard_after_forward: bool = True, prefetch: bool = False,
                 comms: list[ShardCollectives] | None = None, grad_dtype: tf.DType | None = None):
        self.layer, self.params, self.comm = layer, params, comm
        self.grad_dtype = grad_dtype  # the weight gradients are reduce-scattered in it (None: the parameters')
        # `comms[j]`: the collectives of params[j]'s pieces (under tensor parallelism a unit's weights live on
        # several device groups, one per position on the model axis); by default all `comm`. One all-gather and
        # one reduce-scatter per group, all in one merge_call.
        comms = list(comms) if comms is not None else [comm] * len(params)
        groups: dict[int, tuple[ShardCollectives, list[int]]] = {}
        for j, c in enumerate(comms):
            groups.setdefault(id(c), (c, []))[1].append(j)
        self.groups = list(groups.values())
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.name = layer.name
        self.stock_call = fsdp_keras.original_call(layer)
        sharded = {id(v) for v, _ in params}
        self.others = [v for v in layer.variables if id(v) not in sharded]
        self.piece_sizes = [p.piece_size for _, p in params]
        for _, p in params:
            p.owner = p.owner or layer.name
        fsdp_keras.set_call(layer, self.call)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unit's weights while gathered (padded), on each replica."""
        return sum(p.piece_size * p.num_shards * p.dtype.size for _, p in self.params)

    def call(self, *args, **kwargs):
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.distribute.has_strategy():
            return self._run_stock(args, kwargs)
        replica = fsdp_keras.local_replica_index(ctx)
        # Mixed precision: Layer.__call__ casts float weights to the compute dtype while the call runs; the
        # backward's recompute runs outside that call and must cast the gathered weights the same way.
        cast_to = fsdp_keras.autocast_dtype()
        pieces = [p.components[replica].read_value() for _, p in self.params]  # recorded: the tape's sources
        others = [tf.convert_to_tensor(v) for v in self.others]
        leaves = tf.nest.flatten((args, kwargs))
        at = [k for k, x in enumerate(leaves) if tf.is_tensor(x)]
        xs = [leaves[k] for k in at]
        nx, npieces = len(xs), len(pieces)
        shape: dict = {}

        def run(weights, values, inputs):
            filled = list(leaves)
            for k, x in zip(at, inputs):
                filled[k] = x
            a, kw = tf.nest.pack_sequence_as((args, kwargs), filled)
            mapping = [(v, w) for (v, _), w in zip(self.params, weights)] + list(zip(self.others, values))
            current_unit().append(self.name)
            try:
                # A split layer's per-device blocks (custom gradients) read the weights by closure: they must
                # still differentiate them.
                with (fsdp_keras.autocast(cast_to), keras.StatelessScope(state_mapping=mapping) as scope,
                      differentiable_captures(weights)):
                    out = self.stock_call(*a, **kw)
            finally:
                current_unit().pop()
            updated = [(v, scope.get_current_value(v)) for v, old in zip(self.others, values)]
            return out, [(v, new) for (v, new), old in zip(updated, values) if new is not None and new is not old]

        @tf.custom_gradient
        def block(*flat):
            inputs, mine, values = flat[:nx], flat[nx:nx + npieces], flat[nx + npieces:]
            # Gather when the inputs exist, not earlier: with no data dependency TF would run every
            # unit's all-gather at the start of the step and hold all parameters at once.
            gathered = self.gather(ctx, mine, after=self._issue_after("forward", inputs))
            out, updates = run(gathered, values, inputs)
            outs = tf.nest.flatten(out)
            shape.update(out=out, n=len(outs), updated=[v for v, _ in updates])

            def grad(*dys):
                if self.reshard_after_forward:  # gathered again, at its backward
                    weights = self.gather(ctx, mine, after=self._issue_after(
                        "backward", [d for d in dys if d is not None]))
                else:  # the forward's tensors, kept alive until here by this use
                    weights = [tf.identity(w) for w in gathered]
                # New tensors for the recompute: a layer that caches its output per input tensor (tensor
                # parallelism's fused query/key/value projections) must compute again, under this tape.
                fresh = [_fresh(x) for x in inputs]
                floats = [x for x in fresh if x.dtype.is_floating]
                with tf.GradientTape() as tape:
                    tape.watch(floats + weights)
                    again, _ = run(weights, values, fresh)
                # Only the outputs that got a gradient: a weight that reaches none of them (a head without a
                # loss, when one unit holds several heads) gets None, as Keras gives it outside a unit, so the
                # optimizer leaves it and its state alone instead of stepping on a zero gradient. The tape hands
                # such an output zeros made from nothing but its shape (`_no_gradient`); a gradient computed from
                # the loss is not, unless the output reaches the loss only through ops whose gradient is zero by
                # definition (tf.sign, tf.round), where the weights then keep their values as with no loss.
                used = [(o, d) for o, d in zip(tf.nest.flatten(again), dys) if not _no_gradient(d)]
                grads = (tape.gradient([o for o, _ in used], floats + weights, output_gradients=[d for _, d in used],
                                       unconnected_gradients=tf.UnconnectedGradients.NONE)
                         if used else [None] * (len(floats) + len(weights)))
                by_input = iter(tf.zeros_like(x) if g is None else g for x, g in zip(floats, grads[:len(floats)]))
                dx = [next(by_input) if x.dtype.is_floating else None for x in inputs]
                unused = [g is None for g in grads[len(floats):]]
                # Every replica traces the same step, so the reduce-scatter still runs with every piece (zeros
                # for the unused ones): the collective's shape does not depend on which outputs had a loss.
                # A lookup's gradient (IndexedSlices) reaches the optimizer as slices of the piece instead
                # (`_lookup_pieces`), as stock Keras hands slices to its update.
                weight_grads = grads[len(floats):]
                lookups = [j for j, g in enumerate(weight_grads) if isinstance(g, tf.IndexedSlices)]
                summed = self._reduce_scatter(ctx, [tf.zeros_like(w) if g is None else g
                                                    for j, (w, g) in enumerate(zip(weights, weight_grads))],
                                              skip=frozenset(lookups))
                for j, piece in zip(lookups, self._lookup_pieces(ctx, lookups, weight_grads)):
                    summed[j] = piece
                return dx + [None if u else g for g, u in zip(summed, unused)] + [None] * len(values)

            return outs + [new for _, new in updates], grad

        result = block(*xs, *pieces, *others)
        for v, new in zip(shape["updated"], result[shape["n"]:]):
            v.assign(new)
        return tf.nest.pack_sequence_as(shape["out"], result[:shape["n"]])

    def _issue_after(self, phase: str, mine: list) -> list:
        """What this unit's all-gather waits for: its own inputs (forward) or output gradients
        (backward); with prefetch, those of the unit that ran just before it in this phase of this
        trace instead, so the gather overlaps that unit's compute (DeepSpeed's and FSDP's prefetch of
        the next unit in execution order) and at most two units' weights are gathered at once."""
        graph = tf.compat.v1.get_default_graph()
        previous = _last.get(phase)
        _last[phase] = (graph, list(mine))
        if self.prefetch and previous is not None and previous[0] is graph and previous[1]:
            return previous[1]
        return list(mine)

    def _run_stock(self, args, kwargs):
        current_unit().append(self.name)
        try:
            return self.stock_call(*args, **kwargs)
        finally:
            current_unit().pop()

    # --- collectives (replica context: one merge_call each, the replicas' values meet there) ---------
    def gather(self, ctx, pieces, after=()) -> list[tf.Tensor]:
        """This replica's full weights from every replica's pieces: per device group, one all-gather of the
        concatenation of its pieces, issued only once the tensors `after` exist."""
        with tf.control_dependencies(list(after)):
            local = [tf.concat([pieces[j] for j in js], 0) if len(js) > 1 else tf.identity(pieces[js[0]])
                     for _, js in self.groups]
        fulls = ctx.merge_call(self._merge_gather, args=tuple(local))
        out = [None] * len(self.params)
        for full, (comm, js) in zip(fulls, self.groups):
            sizes = [self.piece_sizes[j] for j in js]
            rows, start = tf.reshape(full, [comm.num_shards, sum(sizes)]), 0
            for j, k in zip(js, sizes):
                p = self.params[j][1]
                flat = tf.reshape(rows[:, start:start + k], [-1])[:p.size]
                out[j] = tf.reshape(flat, p.shape)
                start += k
        return out

    def _merge_gather(self, strategy, *local):
        return tuple(to_local_replicas(strategy, comm.all_gather(list(strategy.experimental_local_results(x))),
                                  min(comm.shard_ids)) for x, (comm, _) in zip(local, self.groups))

    def _reduce_scatter(self, ctx, grads, skip=frozenset()) -> list:
        """This replica's pieces of the sum over replicas of the weight gradients, except those of the weights in
        `skip` (None: lookups, which travel as slices). `skip` is the same on every replica (one trace)."""
        chunks, groups = [], self._groups_without(skip)
        for comm, js in groups:
            n, flats = comm.num_shards, []
            for j in js:
                p, k = self.params[j][1], self.piece_sizes[j]
                flat = tf.reshape(tf.cast(grads[j], p.dtype), [-1])
                flats.append(tf.pad(flat, [[0, n * k - p.size]]) if n * k > p.size else flat)
            # One chunk per destination replica (its pieces of the group's weights), built straight from the
            # gradients: one unit-sized copy in flight next to the gradient itself.
            for r in range(n):
                parts = [f[r * self.piece_sizes[j]:(r + 1) * self.piece_sizes[j]] for f, j in zip(flats, js)]
                chunk = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
                chunks.append(chunk if self.grad_dtype is None else tf.cast(chunk, self.grad_dtype))
        out = [None] * len(self.params)
        if not chunks:
            return out
        mine = ctx.merge_call(functools.partial(self._merge_reduce_scatter, frozenset(skip)), args=tuple(chunks))
        for summed, (_, js) in zip(mine, groups):
            sizes = [self.piece_sizes[j] for j in js]
            summed = tf.cast(summed, self.params[js[0]][1].dtype)  # from grad_dtype, if summed in it
            for j, g in zip(js, tf.split(summed, sizes) if len(js) > 1 else [summed]):
                out[j] = g
        return out

    def _lookup_pieces(self, ctx, lookups: list[int], grads: list) -> list[tf.IndexedSlices]:
        """This replica's piece of each lookup gradient `grads[j]` (j in `lookups`) as element slices: every
        replica's lookups, all-gathered, that fall into the piece (`sliced_gradients.piece_slices`)."""
        if not lookups:
            return []
        rows = [rows_of(grads[j], self.params[j][1].shape) for j in lookups]
        rows = [(ix, tf.cast(vals, self.params[j][1].dtype)) for j, (ix, vals) in zip(lookups, rows)]
        found = ctx.merge_call(functools.partial(self._merge_lookup_pieces, list(lookups)), args=tuple(rows))
        return [tf.IndexedSlices(values, positions, tf.constant([self.piece_sizes[j]], tf.int64))
                for j, (positions, values) in zip(lookups, found)]

    def _merge_lookup_pieces(self, lookups: list[int], strategy, *rows):
        local, out = strategy.experimental_local_results, []
        comm_of = {j: comm for comm, js in self.groups for j in js}
        for j, (indices, values) in zip(lookups, rows):
            comm = comm_of[j]
            found = piece_slices(comm, local(indices), local(values), self.piece_sizes[j])
            out.append(tuple(to_local_replicas(strategy, [f[k] for f in found], min(comm.shard_ids)) for k in (0, 1)))
        return tuple(out)

    def _groups_without(self, skip) -> list[tuple]:
        """`self.groups` without the weights in `skip`, and without groups left empty."""
        groups = [(comm, [j for j in js if j not in skip]) for comm, js in self.groups]
        return [(comm, js) for comm, js in groups if js]

    def _merge_reduce_scatter(self, skip, strategy, *chunks):
        out, at = [], 0
        for comm, _ in self._groups_without(skip):
            n = comm.num_shards
            local = [strategy.experimental_local_results(c) for c in chunks[at:at + n]]  # [destination][replica]
            at += n
            out.append(to_local_replicas(strategy, comm.reduce_scatter(
                [[local[r][i] for r in range(n)] for i in range(len(comm.devices))]), min(comm.shard_ids)))
        return tuple(out)


class _LastIssued(threading.local):
    """Per thread (each replica traces in its own): the graph and tensors the last unit's gather of
    each phase waited for."""

    def __init__(self):
        self.by_phase: dict = {}

    def get(self, phase):
        return self.by_phase.get(phase)

    def __setitem__(self, phase, value):
        self.by_phase[phase] = value


_last = _LastIssued()


def _no_gradient(dy) -> bool:
    """True for an output gradient that is None or the tape's zeros for an output the loss does not use: a constant
    when the output's shape is known while tracing, a `ZerosLike` of the output otherwise (traced steps only)."""
    if dy is None:
        return True
    if not tf.is_symbolic_tensor(dy):  # run eagerly: a value, whose zeros cannot be told from a real zero gradient
        return False
    if dy.op.type == "ZerosLike":
        return True
    value = tf.get_static_value(dy)
    return value is not None and not np.any(value)


def _fresh(x: tf.Tensor) -> tf.Tensor:
    """A new tensor equal to `x`, where `x` is."""
    with tf.device(x.device):
        return tf.identity(x)


def to_local_replicas(strategy, values: list, first: int):
    """Local replica i (global replica `first + i`) gets values[i] back from a merge_call. `first` is this process's
    first global replica: the smallest of the group's local shard ids, which are this process's replicas in some
    order (across processes a group's shard ids follow TF's rank of its devices, not the local replica order)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group - first])
