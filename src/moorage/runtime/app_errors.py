"""The errors an agent's app gives its callers (502 app-unavailable, 503 app-busy and instance-stopped, 504
on-wake-timeout, 413), shared
by the HTTP relay (``app_proxy.py``) and the WebSocket relay (``app_socket.py``)."""

from __future__ import annotations

from typing import Any

from moorage.errors import MoorageError, UnavailableError
from moorage.sandbox import SandboxStateError


class AppUnavailable(UnavailableError):
    """The agent's app did not answer properly (not listening, closed early, malformed, too slow)."""

    code = "app-unavailable"
    http_status = 502
    for_caller = True


class AppBusy(UnavailableError):
    """The guest already holds as many connections to the app as it allows: the app is busy, not down."""

    code = "app-busy"
    for_caller = True

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        #: Read by the API's problem+json: a connection frees as soon as one of the app's requests ends.
        self.retry_after = 1


class InstanceStopped(UnavailableError):
    """The instance's processes ended under the request (the agent or its app crashed) before the host noticed: the
    next request starts it again."""

    code = "instance-stopped"
    for_caller = True

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after = 1


class OnWakeTimeout(MoorageError):
    """The agent's ``on_wake``, run before the first app request after a start or a wake, did not return within the
    wait the request allows it (``[agent.limits] turn_timeout_s``, or ``app_timeout_s`` if shorter)."""

    code = "on-wake-timeout"
    http_status = 504
    for_caller = True

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"the agent's on_wake did not return within {wait_s:g} s, so its app was not reached",
                         hint="start the app's processes from on_wake without waiting for them (ctx.spawn returns at "
                              "once); it goes on running and the next request waits for it again; the wait is "
                              "[agent.limits] turn_timeout_s in moorage.toml, or the host's app_timeout_s if shorter")


def live_channel(sandbox: Any) -> Any:
    """The channel of the sandbox a request holds; one whose processes just died is a 503 to retry, not the
    sandbox's own state error (a 409 telling the caller to wake it)."""
    try:
        return sandbox.channel
    except SandboxStateError:
        raise InstanceStopped("the agent's instance stopped; the next request starts it again",
                              hint="retry in a moment") from None


class AppTooLarge(MoorageError):
    code = "app-too-large"
    http_status = 413
