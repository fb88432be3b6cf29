"""The channel's wire format, shared by both of its ends' host side: length-prefixed JSON frames (4-byte big-endian
length, then UTF-8 JSON), their size and nesting limits, and the JSON-RPC error codes. Described in docs/channel.md."""

from __future__ import annotations

import json
import struct
from typing import Any

from moorage.sandbox.base import ChannelError

#: Largest frame either side accepts (payload bytes, without the 4-byte header).
MAX_FRAME = 8 << 20
#: Deepest JSON nesting a frame may carry; deeper is a protocol error (no real message nests past ~6).
MAX_DEPTH = 64
HEADER = struct.Struct(">I")

# Error codes (JSON-RPC 2.0 where one exists).
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
CANCELLED = -32800
TOO_LARGE = -32001
BUSY = -32002
APPLICATION_ERROR = -32000


def json_depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests containers deeper than ``limit`` (iterative: a deep value cannot overflow the stack)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        cur, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(cur, dict):
            stack.extend((v, depth + 1) for v in cur.values() if isinstance(v, (dict, list)))
        elif isinstance(cur, list):
            stack.extend((v, depth + 1) for v in cur if isinstance(v, (dict, list)))
    return False


def decode_payload(payload: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Parse one frame's payload; raises ``ValueError`` for bad UTF-8, bad JSON or nesting past ``max_depth``."""
    # A payload with fewer brackets than the limit cannot nest past it: the common case skips the walk.
    brackets = payload.count(b"[") + payload.count(b"{")
    try:
        msg = json.loads(payload.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    if brackets > max_depth and json_depth_exceeds(msg, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return msg


def encode_frame(msg: Any, max_frame: int = MAX_FRAME) -> bytes:
    payload = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(payload) > max_frame:
        raise ChannelError(
            f"message of {len(payload)} bytes exceeds the {max_frame}-byte frame limit",
            hint="send large data in chunks (fs.read/fs.write take offsets)",
        )
    return HEADER.pack(len(payload)) + payload
