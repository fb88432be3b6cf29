"""The guest side of a host call (``ctx`` -> host): refusals become ``ctx.HostError`` with their kind, and a host
that keeps answering "busy" ends the call after its timeout instead of holding the turn forever."""

from __future__ import annotations

from typing import Any

import pytest

from moorage.guest.agent import HostError, _Host
from moorage.guest.rpc import BUSY, RpcError


class _Peer:
    def __init__(self, error: RpcError) -> None:
        self.error, self.calls = error, 0

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        self.calls += 1
        raise self.error


class _Rpc:
    def __init__(self, peer: _Peer) -> None:
        self.peer = peer


async def test_a_host_that_stays_busy_ends_the_call_after_its_timeout() -> None:
    peer = _Peer(RpcError("busy", BUSY))
    with pytest.raises(HostError) as e:
        await _Host(_Rpc(peer), "t1").call("memory.search", {}, timeout=0.2)  # type: ignore[arg-type]
    assert e.value.kind == "busy" and peer.calls > 3  # retried with a growing pause, then gave up


async def test_a_refusal_keeps_its_kind_and_hint_and_other_errors_pass_unchanged() -> None:
    refused = _Peer(RpcError("egress to x refused (allow it)", -32000,
                             {"type": "EgressDenied", "kind": "egress-denied", "hint": "allow it"}))
    with pytest.raises(HostError) as e:
        await _Host(_Rpc(refused), "t1").call("net.fetch", {})  # type: ignore[arg-type]
    assert (e.value.kind, e.value.hint, refused.calls) == ("egress-denied", "allow it", 1)
    plain = _Peer(RpcError("channel closed: gone", -32603))
    with pytest.raises(RpcError) as raw:
        await _Host(_Rpc(plain), "t1").call("net.fetch", {})  # type: ignore[arg-type]
    assert not isinstance(raw.value, HostError)
