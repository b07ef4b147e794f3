"""Wire types: every numeric dtype through collectives whose kernels take only a few.

Data movement (broadcast, gathers, all-to-all, send/recv) only copies bytes, so a dtype the backend
lacks travels bitcast to one of the same width (bfloat16 as float16, uint32 as int32, uint64 and
complex64 as int64, complex128 as two int64) or, for 1-byte types and bool, cast to int32.
Reductions need arithmetic: small integers and bool are cast to int32 (uint32 to int64), results
cast back (so sums wrap like NumPy's); uint64 sums and products use two's complement int64 (the
same bits), its max/min flip the sign bit so signed order equals unsigned order; complex sums
reduce the (real, imaginary) pairs. Complex products have no element-wise wire form: the API
gathers and multiplies locally.

Example:
    >>> wire, back = encode_move(tf.constant([1, 2], tf.uint8), frozenset({tf.int32}))
    >>> wire.dtype, back(wire).dtype
    (tf.int32, tf.uint8)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["DTYPES", "carry", "check_numeric", "encode_move", "encode_reduce", "sum_bf16_by_gather", "wire_spec"]

Decode = Callable[[tf.Tensor], tf.Tensor]
_SIGN64 = -(2**63)
#: the dtypes tfdist.comm carries (TF's experimental 2/4/8-bit types are not among them)
DTYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64,
                    tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.complex64, tf.complex128, tf.bool})


def check_numeric(dtype: tf.DType, parameter: str, what: str) -> None:
    """ConfigError unless tfdist.comm carries `dtype` (`DTYPES`)."""
    if dtype not in DTYPES:
        fix = "tf.cast(x, tf.float16)" if dtype.is_floating else "tf.cast(x, tf.float32)"
        raise ConfigError(f"tfdist.comm.{what}: {parameter} has dtype {dtype.name}; collectives take float16/32/64, "
                          f"bfloat16, int8..int64, uint8..uint64, complex64/128 or bool tensors. Convert it first, "
                          f"e.g. {fix}.")


def _identity(y: tf.Tensor) -> tf.Tensor:
    return y


def _bitcast(x: tf.Tensor, wire: tf.DType) -> tuple[tf.Tensor, Decode]:
    dtype = x.dtype
    return tf.bitcast(x, wire), lambda y: tf.bitcast(y, dtype)


def _cast(x: tf.Tensor, wire: tf.DType) -> tuple[tf.Tensor, Decode]:
    dtype = x.dtype
    return tf.cast(x, wire), lambda y: tf.cast(y, dtype)


def encode_move(x: tf.Tensor, native: frozenset[tf.DType]) -> tuple[tf.Tensor, Decode]:
    """`x` as a tensor of a dtype in `native` (same leading shape; complex128 without a 16-byte
    type gains a trailing axis of two words), and the function that undoes it."""
    dtype = x.dtype
    if dtype in native:
        return x, _identity
    size = dtype.size
    if size == 2 and tf.float16 in native:
        return _bitcast(x, tf.float16)
    if size <= 2:
        return _cast(x, tf.int32)
    if size == 4:
        return _bitcast(x, tf.int32)
    if size == 8 and tf.int64 in native:
        return _bitcast(x, tf.int64)
    if size in (8, 16):  # complex128 (and, without an int64 kernel, 8-byte types): a trailing axis of words
        return _bitcast(x, tf.int64 if tf.int64 in native and size == 16 else tf.int32)
    raise ConfigError(f"tfdist.comm: no wire type for dtype {dtype.name}.")


def carry(x: tf.Tensor, native: frozenset[tf.DType], run: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """`run` (a data movement) applied to `x`'s wire form, decoded back to `x`'s dtype."""
    wire, back = encode_move(x, native)
    return back(run(wire))


def sum_bf16_by_gather(all_gather: Callable[[tf.Tensor], tf.Tensor], tensors: list[tf.Tensor], processes: int,
                       accumulate: tf.DType = tf.float32) -> list[tf.Tensor]:
    """The sum over `processes` of `tensors` rounded to bfloat16, for a backend with no bfloat16 all-reduce (Horovod
    0.28): one all-gather of the bfloat16 bits of all of them as one flat buffer, then the copies added here in rank
    order, in `accumulate` (float32: the 'bf16' compression's sum; bfloat16: a bfloat16 sum, rounded at each add as
    a ring all-reduce in bfloat16 rounds). Each result has its tensor's shape and dtype `accumulate`.

    Per process it receives (P - 1) x 2 bytes per value: half of a float32 ring all-reduce's 2 (P - 1) / P x 4 for
    P = 2, as much at P = 4, more beyond.
    """
    flat = tf.concat([tf.reshape(tf.cast(t, tf.bfloat16), [-1]) for t in tensors], axis=0)
    gathered = tf.bitcast(all_gather(tf.bitcast(flat, tf.uint8)), tf.bfloat16)  # [P * n, 2] bytes -> [P * n]
    copies = tf.unstack(tf.reshape(tf.cast(gathered, accumulate), [processes, -1]), processes)
    summed = functools.reduce(tf.add, copies)
    parts = tf.split(summed, tf.stack([tf.size(t) for t in tensors]), num=len(tensors))
    return [tf.reshape(part, tf.shape(t)) for part, t in zip(parts, tensors)]


def wire_spec(dtype: tf.DType, native: frozenset[tf.DType]) -> tuple[tf.DType, list[int], Decode]:
    """For a receiver that knows only the dtype: (wire dtype, trailing wire dims, decode)."""
    wire, back = encode_move(tf.zeros([0], dtype), native)
    return wire.dtype, wire.shape[1:].as_list(), back


def encode_reduce(x: tf.Tensor, op: str, native: frozenset[tf.DType], what: str) -> tuple[tf.Tensor, Decode] | None:
    """`x` as a tensor whose element-wise `op` ('sum', 'prod', 'max', 'min') over ranks, decoded, is
    the reduction of the originals; None when no such form exists (complex prod: gather instead)."""
    dtype = x.dtype
    if dtype in native:
        return x, _identity
    if dtype.is_complex:
        if op in ("max", "min"):
            raise ConfigError(f"tfdist.comm.{what}: op={op!r} is not defined for complex tensors ({dtype.name}); "
                              "use 'sum', 'mean' or 'prod', or reduce tf.math.abs(x).")
        if op == "prod":
            return None
        return _bitcast(x, tf.float32 if dtype == tf.complex64 else tf.float64)  # [..., 2]: real, imaginary
    if dtype == tf.bool:
        return _cast(x, tf.int32)  # sum/max: any, prod/min: all
    if dtype == tf.bfloat16:
        return _cast(x, tf.float32)
    if dtype in (tf.int8, tf.uint8, tf.int16, tf.uint16):
        return _cast(x, tf.int32)
    if dtype == tf.uint32:
        return _cast(x, tf.int64)
    if dtype == tf.uint64:
        bits = tf.bitcast(x, tf.int64)
        if op in ("sum", "prod"):  # modulo 2**64 either way
            return bits, lambda y: tf.bitcast(y, tf.uint64)
        sign = tf.constant(_SIGN64, tf.int64)
        return tf.bitwise.bitwise_xor(bits, sign), lambda y: tf.bitcast(tf.bitwise.bitwise_xor(y, sign), tf.uint64)
    if tf.float32 in native and dtype.is_floating:
        return _cast(x, tf.float32 if dtype.size <= 4 else tf.float64)
    raise ConfigError(f"tfdist.comm.{what}: cannot reduce dtype {dtype.name} on this backend.")
