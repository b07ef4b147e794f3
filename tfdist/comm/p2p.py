"""Point-to-point: `send` and `recv` between two processes (global ranks).

Each message is a header (dtype, number of dimensions, dimensions; MAX_DIMS + 2 int64) and then the
tensor, so the receiver learns the shape and checks it against its `like=`. Messages between two
processes arrive in the order they were sent; a send returns once the receiver has it, so two
processes that both send to each other first wait for each other: order them (even ranks send first).

Example (2 processes):
    >>> if tfdist.comm.rank() == 0:
    ...     tfdist.comm.send(tf.range(3), dst=1)
    ... else:
    ...     tfdist.comm.recv(src=0, like=tf.int32).numpy()
    array([0, 1, 2], dtype=int32)
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.comm.arguments import as_tensor, check_rank, parse_like
from tfdist.comm.process_group import Backend
from tfdist.comm.signatures import MAX_DIMS
from tfdist.comm.state import backend_for, guard
from tfdist.comm.wire import carry, wire_spec
from tfdist.errors import ConfigError

__all__ = ["recv", "send"]

_HEADER = MAX_DIMS + 2


def send(x, dst: int) -> None:
    """Sends `x` to the process with global rank `dst`, which calls `recv(src=this rank, like=...)`.

    Example: see `tfdist.comm.p2p`.
    """
    backend = backend_for("send")
    dst = check_rank(dst, backend.size, "dst", "send")
    if dst == backend.rank:
        raise ConfigError(f"tfdist.comm.send: dst={dst} is this process; send to another rank.")
    x = as_tensor(x, "send")
    if x.shape.rank > MAX_DIMS:
        raise ConfigError(f"tfdist.comm.send: x has {x.shape.rank} dimensions; send/recv carry up to {MAX_DIMS} "
                          "(reshape it first).")
    head = tf.concat([tf.constant([x.dtype.as_datatype_enum, x.shape.rank], tf.int64),
                      tf.shape(x, out_type=tf.int64)], 0)
    header = tf.pad(head, [[0, _HEADER - tf.size(head)]], constant_values=-1)
    pair = tuple(sorted((backend.rank, dst)))
    guard("send", pair, lambda: backend.send(header, dst))
    guard("send", pair, lambda: carry(x, backend.move_dtypes, lambda w: backend.send(w, dst)))


def recv(src: int, like) -> tf.Tensor:
    """The tensor the process with global rank `src` sends here. `like` is its dtype (tf.float32, 'int64'),
    a tf.TensorSpec (None dimensions match any size) or a tensor of the expected dtype and shape; what
    arrives is checked against it. Inside tf.function, a `like` with a known number of dimensions gives
    the result a known rank.

    Example: see `tfdist.comm.p2p`.
    """
    backend = backend_for("recv")
    src = check_rank(src, backend.size, "src", "recv")
    if src == backend.rank:
        raise ConfigError(f"tfdist.comm.recv: src={src} is this process; a process cannot receive from itself.")
    dtype, expected = parse_like(like, "recv")
    if expected is not None and (expected.rank or 0) > MAX_DIMS:
        raise ConfigError(f"tfdist.comm.recv: like has {expected.rank} dimensions; send/recv carry up to {MAX_DIMS}.")
    pair = tuple(sorted((backend.rank, src)))
    header = guard("recv", pair, lambda: backend.recv(src, tf.constant([_HEADER]), tf.int64))
    if tf.executing_eagerly():
        code, ndims, *dims = (int(v) for v in header.numpy())
        got = (tf.as_dtype(code), tuple(dims[:ndims]))
        if got[0] != dtype or (expected is not None and not expected.is_compatible_with(got[1])):
            _payload(backend, src, tf.constant(got[1], tf.int64), got[0], pair)  # keeps the pair in step
            want = f"{dtype.name} {tuple(expected) if expected is not None else '(any shape)'}"
            raise ConfigError(f"tfdist.comm.recv: rank {src} sent {got[0].name} {got[1]}; like= expects {want}.")
        return _payload(backend, src, tf.constant(got[1], tf.int64), dtype, pair)
    rank = expected.rank if expected is not None else None
    with tf.control_dependencies([_header_check(header, dtype, expected, src)]):
        shape = tf.identity(header[2:2 + rank] if rank is not None else header[2:2 + header[1]])
    out = _payload(backend, src, shape, dtype, pair)
    return tf.ensure_shape(out, expected) if expected is not None and rank is not None else out


def _payload(backend: Backend, src: int, shape: tf.Tensor, dtype: tf.DType, pair: tuple[int, ...]) -> tf.Tensor:
    wire_dtype, trailing, back = wire_spec(dtype, backend.move_dtypes)
    wire_shape = tf.concat([shape, tf.constant(trailing, tf.int64)], 0) if trailing else shape
    return guard("recv", pair, lambda: back(backend.recv(src, wire_shape, wire_dtype)))


def _header_check(header: tf.Tensor, dtype: tf.DType, expected: tf.TensorShape | None, src: int) -> tf.Operation:
    """Inside tf.function: an Assert that the header matches `like` (dtype, and rank and known dims)."""
    ok = tf.equal(header[0], dtype.as_datatype_enum)
    if expected is not None and expected.rank is not None:
        ok &= tf.equal(header[1], expected.rank)
        for i, d in enumerate(expected.as_list()):
            if d is not None:
                ok &= tf.equal(header[2 + i], d)
    message = (f"tfdist.comm.recv: what rank {src} sent does not match like={dtype.name} {expected}; header "
               "[dtype enum, ndims, dims...]:")
    return tf.debugging.Assert(ok, [message, header], summarize=16)
