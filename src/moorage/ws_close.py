"""WebSocket close codes (RFC 6455 section 7.4.1) as moorage passes them on: the agent's app socket
(``runtime/app_socket.py``) and its host-to-host relay (``fleet/forward.py``) use the same rules."""

from __future__ import annotations

from websockets.frames import Close

NORMAL, GOING_AWAY, TOO_BIG, INTERNAL = 1000, 1001, 1009, 1011


def sendable_close_code(code: int) -> int:
    """A close code that may be sent on: the reserved ones (no status, abnormal, TLS) say what they stand for."""
    code = {1005: NORMAL, 1006: GOING_AWAY, 1015: INTERNAL}.get(code, code)
    try:
        Close(code, "").check()
    except Exception:  # noqa: BLE001 - a code no endpoint may send: the plain one
        return NORMAL
    return code


def sendable_reason(reason: str) -> str:
    """A close reason that may be sent on: at most 123 bytes of UTF-8, an app's passes whole, a longer one of our
    own is cut at a character."""
    return reason.encode()[:123].decode(errors="ignore")
