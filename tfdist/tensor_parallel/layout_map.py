"""tfdist.LayoutMap: variable path regex -> axis names per dimension, as `keras.distribution.LayoutMap`."""

from __future__ import annotations

import collections
import re
import warnings
from collections.abc import Iterator, MutableMapping

from tfdist.errors import ConfigError
from tfdist.tensor_parallel.mesh import DeviceMesh, as_device_mesh

__all__ = ["LayoutMap", "as_layout_map"]

Layout = tuple  # one entry per variable dimension: a mesh axis name or None (not split)


class LayoutMap(MutableMapping):
    """Which dimension of which variable is split over which mesh axis (Keras' LayoutMap semantics).

    Keys are regular expressions over variable paths (`variable.path`, e.g. "dense_1/kernel"); values
    are tuples with one entry per dimension: a mesh axis name, or None. Lookup follows Keras: an exact
    key first, else every key is `re.fullmatch`ed against the path; two matching keys are an error,
    none means "replicated". So a LayoutMap written for Keras-on-JAX works here unchanged.

    Args:
        device_mesh: a `tfdist.DeviceMesh` (or a `keras.distribution.DeviceMesh`).

    Example:
        >>> import tfdist
        >>> tfdist.devices.virtual_cpus(4)
        >>> mesh = tfdist.DeviceMesh((2, 2), ("batch", "model"), ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
        >>> layout_map = tfdist.LayoutMap(mesh)
        >>> layout_map["dense.*kernel"] = (None, "model")      # column-parallel
        >>> layout_map["dense.*bias"] = ("model",)
        >>> layout_map["proj.*kernel"] = ("model", None)       # row-parallel
        >>> layout_map["dense_3/kernel"]
        (None, 'model')
        >>> layout_map["proj/bias"] is None                     # no rule: replicated
        True
    """

    def __init__(self, device_mesh):
        self._mesh = as_device_mesh(device_mesh)
        self._layouts: collections.OrderedDict[str, Layout] = collections.OrderedDict()

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    def __getitem__(self, key: str) -> Layout | None:
        if key in self._layouts:
            return self._layouts[key]
        matching = self.matching_keys(key)
        if len(matching) > 1:
            raise ConfigError(f"variable {key!r} matches several LayoutMap keys: {matching}; make each variable "
                              "path match at most one key (anchor the regexes, e.g. 'dense_1/kernel').")
        return self._layouts[matching[0]] if matching else None

    def matching_keys(self, path: str) -> list[str]:
        """Every key whose regex fully matches `path` (an exact key alone if there is one)."""
        if path in self._layouts:
            return [path]
        return [key for key in self._layouts if re.fullmatch(key, path)]

    def __setitem__(self, key: str, layout) -> None:
        if not isinstance(key, str):
            raise ConfigError(f"LayoutMap keys are regexes over variable paths (str), got {key!r}.")
        if key in self._layouts:
            raise ConfigError(f"LayoutMap key {key!r} already holds {self._layouts[key]}; keys must be unique.")
        try:
            re.compile(key)
        except re.error as err:
            raise ConfigError(f"LayoutMap key {key!r} is not a valid regular expression: {err}.") from None
        axes = getattr(layout, "axes", layout)  # a keras.distribution.TensorLayout, or a tuple/list
        if not isinstance(axes, (tuple, list)):
            raise ConfigError(f"LayoutMap[{key!r}] must be a tuple of mesh axis names or None, got {layout!r}.")
        axes = tuple(axes)
        for axis in axes:
            if axis is not None and axis not in self._mesh.axis_names:
                raise ConfigError(f"LayoutMap[{key!r}] = {axes} names axis {axis!r}, which the mesh lacks; the "
                                  f"mesh's axes are {self._mesh.axis_names} (use None for a dimension not split).")
        named = [a for a in axes if a is not None]
        if len(named) != len(set(named)):
            raise ConfigError(f"LayoutMap[{key!r}] = {axes} splits two dimensions over the same axis.")
        self._layouts[key] = axes

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        return f"<LayoutMap {dict(self._layouts)} on {self._mesh}>"

    def resolve(self, paths_and_shapes: list[tuple[str, tuple]], *, model_name: str = "model") -> dict[str, Layout]:
        """path -> layout for every variable a rule matches, checked against the mesh; warns for rules that
        match nothing. Raises ConfigError for two rules on one variable, a layout of the wrong rank, or a
        dimension its axis size does not divide (naming the sizes that would)."""
        used: set[str] = set()
        out: dict[str, Layout] = {}
        for path, shape in paths_and_shapes:
            keys = self.matching_keys(path)
            if len(keys) > 1:
                raise ConfigError(f"variable {path!r} matches several LayoutMap keys: {keys}; make each variable "
                                  "path match at most one key (anchor the regexes, e.g. 'dense_1/kernel').")
            if not keys:
                continue
            used.add(keys[0])
            layout = self._layouts[keys[0]]
            if len(layout) != len(shape):
                raise ConfigError(f"LayoutMap[{keys[0]!r}] = {layout} has {len(layout)} entries but variable "
                                  f"{path!r} has shape {tuple(shape)} ({len(shape)} dimensions); give one axis name "
                                  "or None per dimension.")
            for dim, (size, axis) in enumerate(zip(shape, layout)):
                parts = self._mesh.axis_size(axis) if axis is not None else 1
                if size % parts:
                    fits = [n for n in range(1, size + 1) if size % n == 0]
                    raise ConfigError(f"variable {path!r} (shape {tuple(shape)}): dimension {dim} of size {size} "
                                      f"cannot be split over axis {axis!r} of size {parts}; axis sizes that divide "
                                      f"it: {fits}. Change the layer's size or the mesh, or leave that dimension "
                                      "None.")
            out[path] = layout
        for key in self._layouts:
            if key not in used:
                warnings.warn(f"LayoutMap key {key!r} matches no variable of {model_name!r}; its variables are "
                              f"{[p for p, _ in paths_and_shapes]}.", stacklevel=3)
        return out

    @classmethod
    def auto(cls, model, mesh, model_dim_name: str = "model") -> LayoutMap:
        """A LayoutMap by the pairing rule. Each MultiHeadAttention (3-D inputs) whose heads the model axis divides
        splits its heads: query/key/value projections column-parallel over the heads, the output projection
        row-parallel. Along each chain of Dense layers (a Dense whose only input is the
        previous Dense's output, that output feeding nothing else), the first of each pair is column-parallel
        (kernel (None, model), bias (model,)) and the second row-parallel (kernel (model, None), bias
        replicated): one all-reduce forward and one backward per pair. Pairs whose hidden size the model axis
        does not divide stay replicated. Keys are the variables' paths (escaped) below the model: the model's own
        name may differ (`sequential/...` vs `sequential_1/...`), so the map also fits another instance of the same
        architecture, built later in the strategy's scope.

        Example:
            >>> layout_map = tfdist.LayoutMap.auto(model, mesh)
            >>> dict(layout_map)
            {'dense/kernel': (None, 'model'), 'dense/bias': ('model',), 'dense_1/kernel': ('model', None)}
        """
        import keras

        from tfdist._compat import keras_model

        out = cls(mesh)
        own = f"{model.name}/"

        def key(variable) -> str:
            path = variable.path  # Sequential and subclassed models put their own (instance) name first
            return ("(?:[^/]+/)?" + re.escape(path[len(own):])) if path.startswith(own) else re.escape(path)

        size = out.device_mesh.axis_size(model_dim_name)
        graph = keras_model.layer_graph(model)
        children: dict[int, list] = collections.defaultdict(list)
        for layer, parents, *_ in graph:
            for parent in parents:
                children[id(parent)].append(layer)
        paired: set[int] = set()
        for layer, *_ in graph:  # attention: heads over the model axis, the output projection row-parallel
            if isinstance(layer, keras.layers.MultiHeadAttention) and layer.num_heads % size == 0:
                for projection in (layer.query_dense, layer.key_dense, layer.value_dense):
                    out[key(projection.kernel)] = (None, model_dim_name, None)
                    if projection.bias is not None:
                        out[key(projection.bias)] = (model_dim_name, None)
                out[key(layer.output_dense.kernel)] = (model_dim_name, None, None)
        for layer, parents, *_ in graph:
            if not isinstance(layer, keras.layers.Dense) or id(layer) in paired:
                continue
            nxt = children[id(layer)]
            if len(nxt) != 1 or not isinstance(nxt[0], keras.layers.Dense) or id(nxt[0]) in paired:
                continue
            second = nxt[0]
            if layer.units % size:
                continue
            paired.update((id(layer), id(second)))
            out[key(layer.kernel)] = (None, model_dim_name)
            if layer.bias is not None:
                out[key(layer.bias)] = (model_dim_name,)
            out[key(second.kernel)] = (model_dim_name, None)
        return out


def as_layout_map(layout_map) -> LayoutMap:
    """A tfdist LayoutMap from itself or a `keras.distribution.LayoutMap` (same keys, axes and mesh)."""
    if isinstance(layout_map, LayoutMap):
        return layout_map
    mesh = getattr(layout_map, "device_mesh", None)
    if mesh is None or not hasattr(layout_map, "keys"):
        raise ConfigError(f"layout_map must be a tfdist.LayoutMap or keras.distribution.LayoutMap, got "
                          f"{type(layout_map).__name__}.")
    out = LayoutMap(mesh)
    for key in layout_map:
        out[key] = layout_map[key]
    return out
