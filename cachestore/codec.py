"""Tensor <-> stored value: raw bytes behind a small self-describing, checksummed header.

A value is ``header || payload``. The header carries dtype, shape, payload length and a
CRC-32 over the header (with the CRC field zeroed) and the payload, so one value can be
checked on its own without the template's manifest. The header length is a multiple of 64
bytes so payloads keep a cache-line aligned offset inside LMDB's overflow pages. No pickle.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from retouch.cachestore.errors import CorruptValue

MAGIC = b"RTV1"
MAX_NDIM = 8
HEADER_ALIGN = 64
COPY_CHUNK = 1 << 20  # verify while the chunk just copied is still in cache

_FIXED = struct.Struct("<4sBBHIIQ")  # magic, dtype, ndim, header_len, crc, reserved, nbytes
_CRC_OFFSET = 8

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
    torch.float8_e4m3fn: 11,  # rows stored in fp8 (their float32 scales are separate values)
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class ValueHeader:
    """Decoded header of one stored value."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc: int
    header_len: int


def dtype_code(dtype: torch.dtype) -> int:
    """Stable on-disk code of a dtype; refuses dtypes the format does not define."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be stored (supported: {list(DTYPE_CODES)})"
        ) from None


def code_dtype(code: int) -> torch.dtype:
    """Inverse of :func:`dtype_code`; an unknown code means corrupt data."""
    try:
        return CODE_DTYPES[code]
    except KeyError:
        raise CorruptValue(f"unknown dtype code {code}") from None


def header_len(ndim: int) -> int:
    """Header bytes for a tensor of ``ndim`` dimensions, rounded up to the alignment."""
    raw = _FIXED.size + 8 * ndim
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def payload_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("payload_view needs a contiguous CPU tensor")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _pack_header(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, crc: int) -> bytes:
    if len(shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions can be stored, got {len(shape)}")
    hlen = header_len(len(shape))
    fixed = _FIXED.pack(MAGIC, dtype_code(dtype), len(shape), hlen, crc, 0, nbytes)
    dims = struct.pack(f"<{len(shape)}q", *shape)
    return (fixed + dims).ljust(hlen, b"\0")


def encode_value(tensor: torch.Tensor) -> bytes:
    """Header plus payload of a contiguous CPU tensor, ready for ``txn.put``."""
    payload = payload_view(tensor)
    shape = tuple(tensor.shape)
    crc = zlib.crc32(payload, zlib.crc32(_pack_header(tensor.dtype, shape, len(payload), 0)))
    return b"".join((_pack_header(tensor.dtype, shape, len(payload), crc), payload))


def parse_header(value: memoryview | bytes) -> ValueHeader:
    """Decode and sanity-check a value's header (not its checksum)."""
    if len(value) < _FIXED.size:
        raise CorruptValue(f"value of {len(value)} bytes is shorter than a header")
    magic, code, ndim, hlen, crc, _, nbytes = _FIXED.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if ndim > MAX_NDIM or hlen != header_len(ndim):
        raise CorruptValue(f"bad header (ndim={ndim}, header_len={hlen})")
    if hlen + nbytes != len(value):
        raise CorruptValue(f"value length {len(value)} != header {hlen} + payload {nbytes}")
    shape = struct.unpack_from(f"<{ndim}q", value, _FIXED.size)
    dtype = code_dtype(code)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if expected != nbytes:
        raise CorruptValue(f"shape {shape} of {dtype} does not match {nbytes} payload bytes")
    return ValueHeader(dtype=dtype, shape=tuple(shape), nbytes=nbytes, crc=crc, header_len=hlen)


def _header_crc(value: memoryview | bytes, header: ValueHeader) -> int:
    """CRC of the header bytes with the CRC field zeroed: the seed of the payload CRC."""
    head = bytearray(value[: header.header_len])
    head[_CRC_OFFSET : _CRC_OFFSET + 4] = b"\0\0\0\0"
    return zlib.crc32(head)


def check_value(value: memoryview | bytes) -> ValueHeader:
    """Parse a value and verify its checksum in place (used by ``verify``)."""
    header = parse_header(value)
    view = memoryview(value)[header.header_len :]
    if zlib.crc32(view, _header_crc(value, header)) != header.crc:
        raise CorruptValue("checksum mismatch")
    return header


def copy_verified(value: memoryview, header: ValueHeader, dest: np.ndarray) -> None:
    """Copy a value's payload into ``dest`` (uint8, same length), verifying the CRC.

    The copy goes chunk by chunk and each chunk is checksummed right after it lands, while
    it is still in cache, so verification costs little on top of the copy itself.
    """
    if dest.nbytes != header.nbytes:
        raise ValueError(f"destination holds {dest.nbytes} bytes, payload is {header.nbytes}")
    src = np.frombuffer(value, dtype=np.uint8, count=header.nbytes, offset=header.header_len)
    crc = _header_crc(value, header)
    for start in range(0, header.nbytes, COPY_CHUNK):
        chunk = dest[start : start + COPY_CHUNK]
        np.copyto(chunk, src[start : start + COPY_CHUNK])
        crc = zlib.crc32(chunk, crc)
    if crc != header.crc:
        raise CorruptValue("checksum mismatch")


def decode_value(value: memoryview | bytes) -> torch.Tensor:
    """A verified, freshly allocated tensor from a stored value (small reads, tests)."""
    header = parse_header(value)
    out = torch.empty(header.shape, dtype=header.dtype)
    copy_verified(memoryview(value), header, out.reshape(-1).view(torch.uint8).numpy())
    return out
