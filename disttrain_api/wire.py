"""numpy arrays <-> protobuf Tensor messages (dtype, shape, raw little-endian bytes)."""

from __future__ import annotations

import math

import numpy as np

from disttrain_api import preprocess_pb2 as pb

_TO_PROTO: dict[np.dtype, pb.DType] = {
    np.dtype(np.uint8): pb.UINT8,
    np.dtype(np.int16): pb.INT16,
    np.dtype(np.int32): pb.INT32,
    np.dtype(np.int64): pb.INT64,
    np.dtype(np.float16): pb.FLOAT16,
    np.dtype(np.float32): pb.FLOAT32,
}
_FROM_PROTO: dict[int, np.dtype] = {code: dtype for dtype, code in _TO_PROTO.items()}


def proto_dtype(dtype: np.dtype, name: str = "") -> pb.DType:
    """The wire's code of tensor ``name``'s ``dtype`` (ValueError for one it does not carry)."""
    code = _TO_PROTO.get(np.dtype(dtype))
    if code is None:
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which the wire does not carry "
                         f"(allowed: {sorted(str(d) for d in _TO_PROTO)})")
    return code


def dtype_of(code: int, name: str = "") -> np.dtype:
    """The numpy dtype (little endian) of tensor ``name``'s wire dtype code (ValueError for an unknown one)."""
    dtype = _FROM_PROTO.get(code)
    if dtype is None:
        raise ValueError(f"tensor {name!r} has unknown dtype code {code}")
    return dtype.newbyteorder("<")


def to_tensor(name: str, array: np.ndarray) -> pb.Tensor:
    dtype = proto_dtype(array.dtype, name)
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return pb.Tensor(name=name, dtype=dtype, shape=list(array.shape), data=data)


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """A read-only numpy view over the message's bytes (no copy)."""
    array = np.frombuffer(tensor.data, dtype=dtype_of(tensor.dtype, tensor.name))
    expected = int(np.prod(tensor.shape)) if tensor.shape else 1
    if array.size != expected:
        raise ValueError(f"tensor {tensor.name!r} holds {array.size} elements, shape {list(tensor.shape)} "
                         f"needs {expected}")
    return array.reshape(tuple(tensor.shape))


IGNORE_INDEX = -100
"""Label of a position the text loss ignores (torch's cross_entropy default ignore_index)."""


def derive_labels(tokens: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """int64 [S, L] next-token labels of a microbatch: ``tokens`` shifted left by one, IGNORE_INDEX
    where ``loss_mask`` is 0 (and in the last column). The service sends only the uint8 mask."""
    if tokens.shape != loss_mask.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {list(tokens.shape)} and loss_mask {list(loss_mask.shape)} must both be [S, L]")
    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:, :-1] = np.where(loss_mask[:, :-1] != 0, tokens[:, 1:], IGNORE_INDEX)
    return labels


# --- Microbatch messages without per-tensor copies ------------------------------------------------
# A Microbatch is mostly a few large Tensor.data fields. Building it through protobuf copies every
# payload into the message and again into the serialized string (and parsing copies it back out),
# so the service writes the wire bytes itself: the small fields through protobuf, each tensor as
# field 6 holding its header fields and then its data, joined with one copy. The result is an
# ordinary serialized Microbatch; any protobuf library parses it.

MAX_SHARED_BYTES = 4 << 30
"""Largest shared-memory microbatch a client maps (Microbatch.shm_nbytes)."""

_LEN, _VARINT = 2, 0
_TENSORS_FIELD, _DATA_FIELD, _SHM_OFFSET_FIELD = 6, 4, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, key start, value start, value end, varint value) of each field in
    buf[start:end]; a length-delimited value starts after its length prefix."""
    pos = start
    while pos < end:
        key_start = pos
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, new = _read_varint(buf, pos)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            value, new = None, pos + length
        elif wire_type == 1:
            value, new = None, pos + 8
        elif wire_type == 5:
            value, new = None, pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type} at byte {pos}")
        if new > end:
            raise ValueError(f"truncated message: field {number} runs past byte {end}")
        yield number, wire_type, key_start, pos, new, value
        pos = new


def encode_microbatch(header: pb.Microbatch, arrays: dict[str, np.ndarray]) -> bytes:
    """Serialized Microbatch: ``header`` (no tensors) plus ``arrays`` as tensors, in one copy."""
    return b"".join(encoded_parts(header, arrays))


def encoded_parts(header: pb.Microbatch, arrays: dict[str, np.ndarray]) -> list:
    """The serialized Microbatch as bytes-like pieces whose concatenation is the message (the
    tensors' data as views of ``arrays``, not copied): to join, or to write where it goes."""
    if not np.little_endian:  # the raw memory would be big endian: let protobuf build it
        message = pb.Microbatch()
        message.CopyFrom(header)
        message.tensors.extend(to_tensor(n, a) for n, a in arrays.items())
        return [message.SerializeToString()]
    parts = [header.SerializeToString()]
    for name, array in arrays.items():
        meta = pb.Tensor(name=name, dtype=proto_dtype(array.dtype, name),
                         shape=list(array.shape)).SerializeToString()
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # a memoryview of the bytes
        data_key = _varint(_DATA_FIELD << 3 | _LEN) + _varint(data.nbytes)
        parts += [_varint(_TENSORS_FIELD << 3 | _LEN), _varint(len(meta) + len(data_key) + data.nbytes),
                  meta, data_key, data]
    return parts


def decode_microbatch(raw) -> tuple[pb.Microbatch, dict[str, np.ndarray]]:
    """(the message without tensors, name -> array viewing ``raw``): nothing copied. ``raw`` is
    bytes (the arrays are read-only) or a writable buffer such as an mmap (they are writable).
    Tensors whose bytes are in a lent shared-memory object (Tensor.shm_offset) stay in the
    message (lent_views makes their arrays)."""
    header_parts, arrays = [], {}
    for number, wire_type, key_start, start, end, _ in _fields(raw, 0, len(raw)):
        view = _tensor_view(raw, start, end) if number == _TENSORS_FIELD and wire_type == _LEN else None
        if view is not None:
            arrays[view[0]] = view[1]
        else:
            header_parts.append(raw[key_start:end])
    return pb.Microbatch.FromString(b"".join(header_parts)), arrays


def _tensor_view(raw, start: int, end: int) -> tuple[str, np.ndarray] | None:
    """(name, array viewing raw) of the Tensor in raw[start:end]; None for a lent one (shm_offset)."""
    name, dtype_code, shape, data = "", 0, [], (start, start)
    for number, wire_type, _, value_start, value_end, value in _fields(raw, start, end):
        if number == _SHM_OFFSET_FIELD:
            return None
        if number == 1:
            name = bytes(raw[value_start:value_end]).decode("utf-8")
        elif number == 2:
            dtype_code = value
        elif number == 3 and wire_type == _LEN:  # packed
            pos = value_start
            while pos < value_end:
                dim, pos = _read_varint(raw, pos)
                shape.append(dim)
        elif number == 3:
            shape.append(value)
        elif number == _DATA_FIELD:
            data = (value_start, value_end)
    dtype = dtype_of(dtype_code, name)
    count = (data[1] - data[0]) // dtype.itemsize
    expected = int(np.prod(shape)) if shape else 1
    if count != expected:
        raise ValueError(f"tensor {name!r} holds {count} elements, shape {shape} needs {expected}")
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=data[0])
    return name, array.reshape(shape)


def lent_views(header: pb.Microbatch, buffer) -> dict[str, np.ndarray]:
    """name -> array viewing ``buffer`` (uint8, a lent object's mapping: each array's base is it)
    of each of header's tensors,
    at its Tensor.shm_offset; ValueError naming the tensor when one does not lie within the
    buffer, is misaligned for its dtype or repeats a name."""
    size, arrays = len(buffer), {}
    for tensor in header.tensors:
        dtype = dtype_of(tensor.dtype, tensor.name)
        if tensor.data or any(d < 0 for d in tensor.shape) or tensor.name in arrays:
            raise ValueError(f"lent tensor {tensor.name!r} has data, a negative extent or a repeated name")
        count = math.prod(tensor.shape)
        offset, nbytes = tensor.shm_offset, count * dtype.itemsize
        if offset % dtype.itemsize or offset + nbytes > size:
            raise ValueError(f"lent tensor {tensor.name!r} ({nbytes} bytes at {offset}) does not lie aligned "
                             f"within the {size}-byte object")
        arrays[tensor.name] = buffer[offset:offset + nbytes].view(dtype).reshape(tuple(tensor.shape))
    return arrays
