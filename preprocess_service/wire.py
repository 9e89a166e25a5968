"""numpy arrays <-> protobuf Tensor messages (dtype, shape, raw little-endian bytes)."""

from __future__ import annotations

import numpy as np

from disttrain_api import preprocess_pb2 as pb

_TO_PROTO = {
    np.dtype(np.uint8): pb.UINT8,
    np.dtype(np.int16): pb.INT16,
    np.dtype(np.int32): pb.INT32,
    np.dtype(np.int64): pb.INT64,
    np.dtype(np.float16): pb.FLOAT16,
    np.dtype(np.float32): pb.FLOAT32,
}
_FROM_PROTO = {code: dtype for dtype, code in _TO_PROTO.items()}


def to_tensor(name: str, array: np.ndarray) -> pb.Tensor:
    dtype = _TO_PROTO.get(array.dtype)
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which the wire does not carry "
                         f"(allowed: {sorted(str(d) for d in _TO_PROTO)})")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return pb.Tensor(name=name, dtype=dtype, shape=list(array.shape), data=data)


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """A read-only numpy view over the message's bytes (no copy)."""
    dtype = _FROM_PROTO.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"tensor {tensor.name!r} has unknown dtype code {tensor.dtype}")
    array = np.frombuffer(tensor.data, dtype=dtype.newbyteorder("<"))
    expected = int(np.prod(tensor.shape)) if tensor.shape else 1
    if array.size != expected:
        raise ValueError(f"tensor {tensor.name!r} holds {array.size} elements, shape {list(tensor.shape)} "
                         f"needs {expected}")
    return array.reshape(tuple(tensor.shape))
