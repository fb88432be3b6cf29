"""The hostile agent of the attack suite: its ``on_message`` attacks the host from inside the sandbox.

Agent code runs inside the guest supervisor, so it can reach everything the supervisor can: the raw channel
transport (``ctx._rpc.peer``), the method registry, the console. Each message names one attack.
"""

AGENT = r'''
import asyncio, base64, ctypes, errno, json, os, socket, struct, sys

def _peer(ctx):
    return ctx._rpc.peer

async def _raw(ctx, payload, length=None):
    peer = _peer(ctx)
    async with peer._write_lock:
        peer.writer.write(struct.pack(">I", len(payload) if length is None else length) + payload)
        await peer.writer.drain()

def _errname(e):
    return errno.errorcode.get(e, str(e))

async def on_message(ctx, message):
    cmd, _, arg = message.partition(" ")
    if cmd == "ping":
        return "pong"
    if cmd == "burst":
        # Honest code can start more host calls at once than the host serves per sandbox: all must succeed.
        got = await asyncio.gather(*(ctx.memory.facts() for _ in range(int(arg))))
        return "served %d" % len(got)
    if cmd == "recall":
        return json.dumps(await ctx.memory.recall(arg or "anything", k=1))
    if cmd == "flood":
        # Requests to the host as fast as the pipe takes them, never waiting for an answer.
        n = int(arg)
        for i in range(0, n, 200):
            batch = b"".join(struct.pack(">I", len(p)) + p for p in (
                json.dumps({"id": "f%d" % j, "method": "durable.history", "params": {"turn_id": ctx.turn_id}}).encode()
                for j in range(i, min(i + 200, n))))
            peer = _peer(ctx)
            async with peer._write_lock:
                peer.writer.write(batch)
                await peer.writer.drain()
        await asyncio.sleep(2)
        return "flooded %d" % n
    if cmd == "deep":
        n = int(arg)
        await _raw(ctx, b'{"id":"deep","method":"durable.history","params":' + b"[" * n + b"]" * n + b"}")
        await _raw(ctx, b'{"id":"deep2","result":' + b'{"a":' * n + b"1" + b"}" * n + b"}")
        return "survived"
    if cmd == "huge":
        # A frame header announcing 4 GiB, then a trickle: the host must not try to read (or allocate) it.
        await _raw(ctx, b"x" * 64, length=0xFFFFFFF0)
        await asyncio.sleep(60)
        return "the host kept listening"
    if cmd == "events":
        n = int(arg)
        pad = "x" * 4000
        for i in range(n):
            await ctx.emit("tick", {"i": i, "pad": pad})
        return "emitted %d" % n
    if cmd == "endless-read":
        # From now on this supervisor answers every file read with more data and never says end-of-file.
        async def endless(params, rpc):
            n = max(0, min(int(params.get("length", 1 << 20)), 1 << 20))
            return {"data": base64.b64encode(b"\0" * n).decode(), "eof": False, "size": 1 << 62}
        _peer(ctx).registry._handlers["fs.read"] = endless
        return "armed"
    if cmd == "console":
        n = int(arg)
        line = b"console flood " + b"x" * 1010 + b"\n"
        try:  # never created: in a process sandbox /dev is the sandbox's own tmpfs, without a console
            out = os.fdopen(os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY), "wb", buffering=0)
        except OSError:
            out = sys.stderr.buffer
        written = 0
        while written < n:
            out.write(line)
            written += len(line)
        out.flush()
        return "wrote %d" % written
    if cmd == "host-paths":
        found = []
        for p in json.loads(arg):
            try:
                if os.path.isdir(p):
                    os.listdir(p)
                else:
                    with open(p, "rb") as f:
                        f.read(16)
                found.append(p)
            except OSError:
                pass
        return json.dumps(found)
    if cmd == "userns":
        libc = ctypes.CDLL(None, use_errno=True)
        out = {}
        for name, flag in (("user", 0x10000000), ("net", 0x40000000), ("mount", 0x00020000)):
            r = libc.unshare(flag)
            out[name] = "OK" if r == 0 else _errname(ctypes.get_errno())
        return json.dumps(out)
    if cmd == "raw-socket":
        out = {}
        for name, fam, kind, proto in (("raw-icmp", socket.AF_INET, socket.SOCK_RAW, 1),
                                       ("packet", 17, socket.SOCK_RAW, 0)):
            try:
                s = socket.socket(fam, kind, proto)
                out[name] = "OK"
                s.close()
            except OSError as e:
                out[name] = _errname(e.errno)
        with open("/proc/net/dev") as f:
            out["interfaces"] = sorted(l.split(":")[0].strip() for l in f.read().splitlines()[2:])
        return json.dumps(out)
    if cmd == "fill-disk":
        # Written by the supervisor itself (agent code runs in it), not by a worker process.
        os.makedirs("/work/fill", exist_ok=True)
        block = b"z" * (16 << 20)
        i = 0
        try:
            while i < 4096:
                with open("/work/fill/%d" % i, "wb") as f:
                    f.write(block)
                    f.flush()
                    os.fsync(f.fileno())
                i += 1
                await asyncio.sleep(0)
        except OSError as e:
            return "stopped after %d files: %s" % (i, _errname(e.errno))
        return "wrote %d files" % i
    if cmd == "clean-disk":
        import shutil
        shutil.rmtree("/work/fill", ignore_errors=True)
        return "cleaned"
    return "echo: " + message
'''
