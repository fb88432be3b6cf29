"""A minimal PNG decoder (stdlib zlib + numpy) for checking screenshots: 8-bit RGB/RGBA, not interlaced,
which is what Chromium writes. Enough to tell a rendered page from a blank one."""

from __future__ import annotations

import struct
import zlib

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode(data: bytes) -> np.ndarray:
    """The image as a (height, width, channels) uint8 array."""
    assert data[:8] == _SIGNATURE, "not a PNG"
    pos, idat, header = 8, bytearray(), None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    assert header is not None, "PNG without IHDR"
    width, height, depth, color, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(color)
    assert depth == 8 and channels and interlace == 0, f"unsupported PNG (depth {depth}, color {color})"
    raw = zlib.decompress(bytes(idat))
    stride = width * channels
    rows: list[bytes] = []
    prev = bytes(stride)
    for y in range(height):
        at = y * (stride + 1)
        ftype, line = raw[at], raw[at + 1:at + 1 + stride]
        if ftype == 0:
            cur = line
        elif ftype == 2:  # Up: vectorised, it needs only the row above
            cur = ((np.frombuffer(line, np.uint8).astype(np.uint16) + np.frombuffer(prev, np.uint8)) & 0xFF).astype(np.uint8).tobytes()
        else:  # Sub, Average, Paeth depend on the byte to the left, so they run byte by byte (plain ints: fast enough)
            out = bytearray(stride)
            for x in range(stride):
                a = out[x - channels] if x >= channels else 0
                b = prev[x]
                if ftype == 1:
                    pred = a
                elif ftype == 3:
                    pred = (a + b) >> 1
                elif ftype == 4:
                    c = prev[x - channels] if x >= channels else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                else:
                    raise AssertionError(f"bad PNG filter {ftype}")
                out[x] = (line[x] + pred) & 0xFF
            cur = bytes(out)
        rows.append(cur)
        prev = cur
    return np.frombuffer(b"".join(rows), np.uint8).reshape(height, width, channels)
