"""The host Channel against the real guest supervisor (system python3, over a socketpair), and against raw peers."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
from pathlib import Path

import pytest

from moorage.guest.rpc import Peer, Registry
from moorage.sandbox import ChannelClosed, ChannelTimeout, GuestProtocolError, RemoteError
from moorage.sandbox.channel import METHOD_NOT_FOUND, Channel, HandlerError, encode_frame
from moorage.sandbox.channel_calls import Event

EXT_SOURCE = '''
"""Test extension: a streaming handler and a handler that calls back into the host."""
import asyncio

async def count(params, ctx):
    for i in range(params["n"]):
        await ctx.emit("tick", i)
    return {"done": params["n"]}

async def ask_host(params, ctx):
    events = []
    answer = await ctx.peer.call("host.add", {"a": params["a"], "b": params["b"]},
                                 on_event=lambda ev, data: events.append([ev, data]))
    return {"answer": answer, "events": events}

async def forever(params, ctx):
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        with open(params["marker"], "w") as f:
            f.write("cancelled")
        raise

async def ask_and_note(params, ctx):
    try:
        await ctx.peer.call("host.never", {})
    except asyncio.CancelledError:
        note = "cancelled"
        raise
    except Exception as e:  # agent code may catch an error and go on: it must not get one when its host is gone
        note = "caught " + type(e).__name__
    finally:
        with open(params["marker"], "w") as f:
            f.write(note)
    return {}

def register(registry):
    registry.add("t.ask_and_note", ask_and_note)
    registry.add("t.count", count)
    registry.add("t.ask_host", ask_host)
    registry.add("t.forever", forever)
'''


async def test_ping_reports_supervisor(start_guest) -> None:
    g = await start_guest()
    r = await g.channel.call("ping", timeout=10)
    assert r["pong"] is True
    assert r["pid"] == g.proc.pid
    assert {"exec", "fs.read", "fs.write", "fs.list", "fs.stat"} <= set(r["methods"])


async def test_exec_streams_output_and_exit_code(start_guest) -> None:
    g = await start_guest()
    s = g.channel.stream("exec", {"argv": ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]}, timeout=20)
    got: dict[str, bytes] = {"stdout": b"", "stderr": b""}
    async for ev in s:
        got[ev.event] += base64.b64decode(ev.data)
    assert s.result == {"exit_code": 3, "timed_out": False}
    assert got == {"stdout": b"out\n", "stderr": b"err\n"}


async def test_exec_timeout_kills_the_process_group(start_guest) -> None:
    g = await start_guest()
    marker = g.workdir / "child-alive"
    # The background child would write the marker after 3 s unless the whole group is killed.
    script = f"(sleep 3; touch {marker}) & sleep 30"
    r = await g.channel.call("exec", {"argv": ["/bin/sh", "-c", script], "timeout": 0.5}, timeout=20)
    assert r["timed_out"] is True
    assert r["exit_code"] < 0
    await asyncio.sleep(3.5)
    assert not marker.exists()


async def test_exec_missing_command_is_127(start_guest) -> None:
    g = await start_guest()
    r = await g.channel.call("exec", {"argv": ["/nonexistent/cmd"]}, timeout=10)
    assert r["exit_code"] == 127


async def test_exec_stdin_and_env(start_guest) -> None:
    g = await start_guest(env={"FROM_SANDBOX": "base"})
    events: list[bytes] = []
    r = await g.channel.call(
        "exec",
        {"argv": ["/bin/sh", "-c", 'cat; echo "$FROM_SANDBOX $FROM_CALL"'], "stdin": base64.b64encode(b"hi\n").decode(),
         "env": {"FROM_CALL": "call"}},
        timeout=10,
        on_event=lambda ev: events.append(base64.b64decode(ev.data)),
    )
    assert r["exit_code"] == 0
    assert b"".join(events) == b"hi\nbase call\n"


async def test_cancel_kills_running_exec(start_guest) -> None:
    g = await start_guest()
    pidfile = g.workdir / "pid"
    async with g.channel.stream("exec", {"argv": ["/bin/sh", "-c", f"echo $$ > {pidfile}; echo go; exec sleep 60"]}) as s:
        async for ev in s:
            assert base64.b64decode(ev.data) == b"go\n"
            break  # leaving the block cancels the call
    pid = int(pidfile.read_text())
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
        except OSError:  # gone (ENOENT), or reaped between open and read (ESRCH)
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("cancelled exec is still running")
    # The channel still works afterwards.
    assert (await g.channel.call("ping"))["pong"]


async def test_fs_roundtrip_list_stat(start_guest) -> None:
    g = await start_guest()
    data = bytes(range(256)) * 10
    await g.channel.call("fs.write", {"path": "d/x.bin", "data": base64.b64encode(data).decode(), "mode": 0o600, "atomic": True})
    assert (g.workdir / "d" / "x.bin").read_bytes() == data
    r = await g.channel.call("fs.read", {"path": "d/x.bin"})
    assert base64.b64decode(r["data"]) == data and r["eof"]
    entries = (await g.channel.call("fs.list", {"path": "d"}))["entries"]
    assert [(e["name"], e["type"], e["size"], e["mode"]) for e in entries] == [("x.bin", "file", len(data), 0o600)]
    assert (await g.channel.call("fs.stat", {"path": "nope"}))["info"] is None
    with pytest.raises(RemoteError) as ei:
        await g.channel.call("fs.read", {"path": "nope"})
    assert ei.value.data["type"] == "FileNotFoundError"


async def test_unknown_method_is_method_not_found(start_guest) -> None:
    g = await start_guest()
    with pytest.raises(RemoteError) as ei:
        await g.channel.call("no.such.method")
    assert ei.value.rpc_code == METHOD_NOT_FOUND


async def test_extension_streams_and_calls_the_host(start_guest, guest_copy: Path) -> None:
    (guest_copy / "testext.py").write_text(EXT_SOURCE)
    g = await start_guest("testext")

    async def add(params, ctx):
        await ctx.emit("thinking", "adding")
        return params["a"] + params["b"]

    g.channel.register("host.add", add)
    s = g.channel.stream("t.count", {"n": 3}, timeout=10)
    assert [ev.data async for ev in s] == [0, 1, 2]
    assert s.result == {"done": 3}
    r = await g.channel.call("t.ask_host", {"a": 2, "b": 40}, timeout=10)
    assert r == {"answer": 42, "events": [["thinking", "adding"]]}


async def test_guest_call_to_unserved_host_method_gets_error(start_guest, guest_copy: Path) -> None:
    (guest_copy / "testext.py").write_text(EXT_SOURCE)
    g = await start_guest("testext")
    with pytest.raises(RemoteError) as ei:
        await g.channel.call("t.ask_host", {"a": 1, "b": 1}, timeout=10)
    assert "host.add" in ei.value.message

    async def broken(params, ctx):
        raise HandlerError("no quota", data={"retry": False})

    g.channel.register("host.add", broken)
    with pytest.raises(RemoteError) as ei:
        await g.channel.call("t.ask_host", {"a": 1, "b": 1}, timeout=10)
    assert "no quota" in ei.value.message


async def test_timeout_cancels_guest_handler(start_guest, guest_copy: Path) -> None:
    (guest_copy / "testext.py").write_text(EXT_SOURCE)
    g = await start_guest("testext")
    marker = g.workdir / "cancelled"
    assert (await g.channel.call("ping", timeout=30))["pong"]  # the guest is up, so the handler really starts
    with pytest.raises(ChannelTimeout):
        await g.channel.call("t.forever", {"marker": str(marker)}, timeout=0.3)
    for _ in range(100):
        if marker.exists():
            break
        await asyncio.sleep(0.05)
    assert marker.read_text() == "cancelled"
    assert (await g.channel.call("ping"))["pong"]
    assert g.channel.rejected_frames == 0  # the late "cancelled" answer is dropped quietly


async def test_a_handler_waiting_on_the_host_when_the_host_goes_away_is_cancelled_not_failed(
        start_guest, guest_copy: Path) -> None:
    """A VM restored from a snapshot sees its old host connection end while a turn waits on a host call: that
    turn is cancelled (its code sees CancelledError, which it does not catch as an error and go on from), so
    nothing it does after the restore point runs after a rollback."""
    (guest_copy / "testext.py").write_text(EXT_SOURCE)
    g = await start_guest("testext")
    marker = g.workdir / "note"
    asked = asyncio.Event()

    async def never(params, ctx):
        asked.set()
        await asyncio.sleep(3600)

    g.channel.register("host.never", never)
    pending = asyncio.ensure_future(g.channel.call("t.ask_and_note", {"marker": str(marker)}, timeout=60))
    await asyncio.wait_for(asked.wait(), 30)
    await g.channel.close()
    with pytest.raises(ChannelClosed):
        await pending
    assert await asyncio.to_thread(g.proc.wait, 30) is not None
    assert marker.read_text() == "cancelled"


# --- malformed frames --------------------------------------------------------------------------------------------


async def _raw_pair() -> tuple[Channel, asyncio.StreamReader, asyncio.StreamWriter]:
    a, b = socket.socketpair()
    r1, w1 = await asyncio.open_connection(sock=a)
    r2, w2 = await asyncio.open_connection(sock=b)
    ch = Channel(r1, w1, name="raw")
    ch.start()
    return ch, r2, w2


async def _read_frame(reader: asyncio.StreamReader) -> dict:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    return json.loads(await reader.readexactly(n))


async def test_host_rejects_invalid_json_and_unknown_ids_and_keeps_working() -> None:
    ch, greader, gwriter = await _raw_pair()
    call = asyncio.ensure_future(ch.call("ping", timeout=10))
    req = await _read_frame(greader)
    bad = b"{not json"
    gwriter.write(struct.pack(">I", len(bad)) + bad)
    gwriter.write(encode_frame([1, 2, 3]))
    gwriter.write(encode_frame({"id": 999, "result": "for nobody"}))
    gwriter.write(encode_frame({"id": 998, "event": "stdout", "data": "x"}))
    gwriter.write(encode_frame({"id": {"x": 1}, "result": 1}))
    gwriter.write(encode_frame({"hello": "world"}))
    gwriter.write(encode_frame({"id": req["id"], "result": {"pong": True}}))
    await gwriter.drain()
    assert await call == {"pong": True}
    assert ch.rejected_frames == 6
    # The host answered the unparseable frames with protocol errors.
    assert (await _read_frame(greader))["error"]["code"] == -32700
    assert (await _read_frame(greader))["error"]["code"] == -32600
    assert not ch.closed
    await ch.close()


async def test_a_cancel_in_the_same_step_as_an_event_is_not_lost() -> None:
    """A caller cancelled in the loop step where an event of its call arrived took the event and ran on (Python
    3.11's ``wait_for`` hands back a result that is ready and drops the cancel): a detached exec cancelled just as
    it printed ran to its timeout and ended ``timed_out``, not ``cancelled``."""
    ch, greader, gwriter = await _raw_pair()
    seen: list[Event] = []

    async def consume() -> None:
        async for ev in ch.stream("exec", {"argv": ["x"]}, timeout=30):
            seen.append(ev)

    task = asyncio.ensure_future(consume())
    req = await _read_frame(greader)
    for _ in range(5):  # the caller is waiting for its next event
        await asyncio.sleep(0)
    ch._pending[req["id"]].events.put_nowait((Event("stdout", "eA=="), 4))  # as the channel's reader delivers it
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert await _read_frame(greader) == {"method": "$cancel", "params": {"id": req["id"]}}
    await ch.close()


async def test_a_guest_handler_cancelled_as_its_host_call_is_answered_is_cancelled() -> None:
    """The guest's side of the same: a handler the host cancelled in the step where the answer to its own call of
    the host arrived took the answer and ran on (a cancelled turn went on to its next tool call)."""
    a, b = socket.socketpair()
    r1, w1 = await asyncio.open_connection(sock=a)
    r2, w2 = await asyncio.open_connection(sock=b)
    peer = Peer(r1, w1, Registry())
    task = asyncio.ensure_future(peer.call("host.model", {}, timeout=30))
    req = await _read_frame(r2)
    for _ in range(5):
        await asyncio.sleep(0)
    peer._pending[req["id"]][0].set_result({"text": "hello"})  # as its reader delivers the host's answer
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert await _read_frame(r2) == {"method": "$cancel", "params": {"id": req["id"]}}
    w1.close()
    w2.close()


async def test_host_drops_connection_on_oversized_frame_without_crashing() -> None:
    ch, greader, gwriter = await _raw_pair()
    call = asyncio.ensure_future(ch.call("ping", timeout=10))
    await _read_frame(greader)
    gwriter.write(struct.pack(">I", 0xFFFFFFF0) + b"xxxx")
    await gwriter.drain()
    with pytest.raises(GuestProtocolError):
        await call
    await asyncio.wait_for(ch.wait_closed(), 5)
    assert ch.rejected_frames == 1
    with pytest.raises(ChannelClosed):
        await ch.call("ping")


async def test_guest_rejects_malformed_frames_and_keeps_serving(start_guest) -> None:
    g = await start_guest()
    writer = g.channel._writer  # write raw bytes on the host side of the real connection
    bad = b"\xff\xfe not utf8"
    writer.write(struct.pack(">I", len(bad)) + bad)
    writer.write(encode_frame({"id": 5, "method": 17}))
    writer.write(encode_frame({"id": 12345, "result": "unknown id"}))
    deep = b'{"id": 6, "method": "ping", "params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past any recursion
    writer.write(struct.pack(">I", len(deep)) + deep)
    await writer.drain()
    assert (await g.channel.call("ping", timeout=10))["pong"]
    assert g.proc.poll() is None
    # The guest's error answers to our garbage arrive as frames for unknown/no ids and are rejected on the host.
    assert g.channel.rejected_frames >= 1


async def test_call_on_dead_guest_raises_channel_closed(start_guest) -> None:
    g = await start_guest()
    g.proc.kill()
    await asyncio.wait_for(g.channel.wait_closed(), 10)
    with pytest.raises(ChannelClosed):
        await g.channel.call("ping")
