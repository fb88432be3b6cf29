"""WebSocket close codes (RFC 6455 section 7.4.1) as moorage passes them on: the agent's app socket
(``runtime/app_socket.py``) and its host-to-host relay (``fleet/forward.py``) use the same rules."""

from __future__ import annotations

from websockets.frames import Close

NORMAL, GOING_AWAY, TOO_BIG, INTERNAL = 1000, 1001, 1009, 1011
#: Service restart: the client should reconnect (``moorage up`` stopping, an instance restarted by a redeploy).
SERVICE_RESTART = 1012
#: Policy violation: the credential that opened a socket was revoked or expired while it was open.
POLICY_VIOLATION = 1008
#: The code that stands for a close frame without one (RFC 6455 7.1.5): never sent, passed on as no code.
NO_STATUS = 1005


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


def caller_close(code: int, reason: str) -> tuple[int | None, str]:
    """The close a caller's close is passed on as (``code``, ``reason`` for ``close``): the caller's own, a close
    without a code (NO_STATUS, what ASGI reports for one) again without one, an empty close frame."""
    if code == NO_STATUS:
        return None, ""
    return sendable_close_code(code), sendable_reason(reason)
