"""Which split a layer's layout asks for: the kind of split forward (column, row, einsum, conv, vocabulary), or
why the layout cannot be honoured on that layer type."""

from __future__ import annotations

import keras

__all__ = ["CONVS", "layer_kind", "split_axis"]

CONVS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def split_axis(layout, model_axis: str) -> int | None:
    if not layout or model_axis not in layout:
        return None
    return list(layout).index(model_axis)


def layer_kind(layer, axes: dict[str, int | None]) -> tuple[str | None, str]:
    """(kind or None for replicated, reason if the layout cannot be honoured)."""
    if isinstance(layer, keras.layers.Dense):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        if kernel == 1:
            return "column", ""
        if kernel == 0:
            if bias is not None:
                return None, ("a row-parallel Dense (kernel split on its input dimension) adds its bias after the "
                              "all-reduce: leave the bias replicated (no rule, or (None,))")
            return "row", ""
        if bias is not None:
            return None, "a Dense bias can be split only together with its kernel's output dimension (None, 'model')"
        return None, ""
    if isinstance(layer, keras.layers.EinsumDense):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        if kernel is None:
            return None, ("an EinsumDense bias can be split only together with its kernel" if bias is not None
                          else "")
        _, kernel_spec, out_spec = layer.equation.replace("->", ",").split(",")
        if kernel_spec[kernel] in out_spec:
            return "einsum_column", ""
        if bias is not None:
            return None, ("an EinsumDense split along a contracted dimension adds its bias after the all-reduce: "
                          "leave the bias replicated")
        return "einsum_row", ""
    if isinstance(layer, CONVS):
        kernel, bias = axes.get("kernel"), axes.get("bias")
        rank = len(layer.kernel.shape)
        if kernel is None and bias is None:
            return None, ""
        if layer.data_format != "channels_last" or layer.groups != 1:
            return None, "a convolution can be split only with data_format='channels_last' and groups=1"
        if kernel == rank - 1:
            return "conv_column", ""
        if kernel == rank - 2 and bias is None:
            return "conv_row", ""
        return None, (f"a {type(layer).__name__} kernel can be split on its output channels (dimension {rank - 1}, "
                      f"bias split alike or replicated) or its input channels (dimension {rank - 2}, bias replicated)")
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        # Either table split on either dimension (the tied table serves both directions; an untied
        # reverse_embeddings is a Dense kernel of shape (features, vocabulary)).
        split = any(axes.get(role) is not None for role in ("embeddings", "reverse_embeddings"))
        return ("reversible" if split else None), ""
    if isinstance(layer, keras.layers.Embedding):
        table = axes.get("embeddings")
        return {0: "vocab", 1: "embedding_features", None: None}[table], ""
    if any(a is not None for a in axes.values()):
        return None, (f"{type(layer).__name__} cannot be split yet (supported: Dense, EinsumDense, Embedding, "
                      "Conv1D/2D/3D, MultiHeadAttention's projections); remove its rule "
                      "from the LayoutMap to run it replicated")
    return None, ""
