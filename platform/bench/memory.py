"""The gateway's memory under hostile use, measured on a real ``retouch serve`` process.

Encoded images are small and their pixels may be huge, and finished jobs are kept for a
day: this bench sends what a hostile tenant would and reads the gateway process's resident
memory (``/proc/<pid>/status``: VmRSS, sampled every 20 ms) against its idle figure.
"""

from __future__ import annotations

import struct
import zlib


def zero_png(width: int, height: int) -> bytes:
    """A genuine all-zero 16-bit RGBA PNG of ``width`` x ``height``: 130 KB for
    4096 x 4096, which decodes to hundreds of MB."""
    row = b"\0" * (1 + width * 8)  # filter byte, then 8 bytes a pixel
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)
