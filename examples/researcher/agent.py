"""A research assistant, one per end-user, written against the agent context (``ctx``) only; no model needed.

Commands (one per turn):

  note TEXT               keep TEXT in the episodic log (user scope) and say what this session said before
  recall QUERY            search the episodic log
  learn ATTRIBUTE VALUE   record a fact about the user (lands pending until the product confirms it)
  facts [AS_OF]           the user's facts true now, or at AS_OF (seconds since the epoch)
  facts known AT          the user's facts as they were believed at AT
  fact ATTRIBUTE          one current fact, with its id
  research TOPIC URL      durable workflow: plan, search URL (with the host's secret), ask a human, write the report
  watch                   start (or find again) the background watcher process
  checkpoint NAME         a named checkpoint of this whole agent instance
  report                  the report on disk

Its page (port 8080) lists the reports; it is started when the agent is loaded, so every user's sandbox has it.
"""

import http.server
import json
import os
import threading

REPORTS = "/work/reports"
WATCHER = "/work/watcher"
WATCHER_PY = """\
import os, time
open("/work/watcher/pid", "w").write(str(os.getpid()))
n = 0
while True:
    n += 1
    open("/work/watcher/ticks.tmp", "w").write(str(n))
    os.replace("/work/watcher/ticks.tmp", "/work/watcher/ticks")
    time.sleep(0.2)
"""


def _reports():
    try:
        return sorted(os.listdir(REPORTS))
    except OSError:
        return []


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/reports.json"):
            body, ctype = json.dumps(_reports()).encode(), "application/json"
        else:
            items = "".join("<li>%s</li>" % name.replace("<", "&lt;") for name in _reports())
            body, ctype = ("<!doctype html><title>research</title><h1>Reports</h1><ul>%s</ul>" % items).encode(), \
                "text/html; charset=utf-8"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve():
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Page).serve_forever()
    except OSError:
        pass  # loaded again in the same sandbox: the first server keeps serving


threading.Thread(target=_serve, daemon=True, name="research-page").start()


async def note(ctx, text):
    # Working memory: the model input moorage keeps for this session (earlier turns and their replies).
    messages = await ctx.memory.context(text, system="You are a research assistant.")
    earlier = [m["content"] for m in messages[1:-1] if m["role"] == "user"]
    event = await ctx.memory.remember(text)
    return {"noted": event, "earlier_in_session": earlier}


async def research(ctx, topic, url):
    plan = await ctx.step("plan", lambda: {"topic": topic, "queries": [topic, topic + " review"]})

    async def search():
        r = await ctx.fetch(url + "?q=" + plan["queries"][0].replace(" ", "+"))
        if r["status"] != 200:
            raise RuntimeError("the search API answered %d" % r["status"])
        return json.loads(r["body"])

    found = await ctx.step("search", search)
    answer = await ctx.interrupt({"question": "Write a report on %r from %d results?" % (topic, len(found["results"])),
                                  "results": found["results"]})
    if str(answer).lower() not in ("yes", "approve", "approved"):
        return "report on %s not written" % topic

    def write():
        os.makedirs(REPORTS, exist_ok=True)
        name = topic.replace(" ", "-") + ".md"
        with open(os.path.join(REPORTS, name), "w") as f:
            f.write("# %s\n\n%s\n" % (topic, "\n".join("- " + r for r in found["results"])))
        return name

    name = await ctx.step("write", write)
    await ctx.memory.remember("wrote the report %s on %s" % (name, topic), kind="report")
    return "wrote %s" % name


async def watch(ctx):
    """Start the watcher, or find the one an earlier turn started (a sleep on the process driver stops it)."""
    try:
        pid = int(ctx.files.read(WATCHER + "/pid"))
        alive = os.path.exists("/proc/%d" % pid)
    except (OSError, ValueError):
        pid, alive = None, False
    if alive:
        return {"watcher": "running", "pid": pid, "ticks": int(ctx.files.read(WATCHER + "/ticks"))}
    ctx.files.write(WATCHER + "/watcher.py", WATCHER_PY)
    p = await ctx.spawn(["python3", WATCHER + "/watcher.py"], log=WATCHER + "/log")  # returns at once; keeps running
    return {"watcher": "started" if pid is None else "restarted", "pid": p["pid"], "was": pid}


async def on_message(ctx, message):
    cmd, _, rest = message.strip().partition(" ")
    if cmd == "note":
        return json.dumps(await note(ctx, rest))
    if cmd == "recall":
        return json.dumps([h["text"] for h in await ctx.memory.recall(rest, k=3)])
    if cmd == "learn":
        attribute, _, value = rest.partition(" ")
        return json.dumps(await ctx.memory.learn("user", attribute, value, "the user's %s is %s" % (attribute, value)))
    if cmd == "facts":
        words = rest.split()  # "facts", "facts AS_OF" (true then) or "facts known AT" (believed then)
        if words[:1] == ["known"]:
            facts = await ctx.memory.facts(known_at=float(words[1]))
        else:
            facts = await ctx.memory.facts(as_of=float(words[0]) if words else None)
        return json.dumps({f["attribute"]: f["value"] for f in facts})
    if cmd == "fact":  # one fact as the agent sees it: its id is the product's handle on it
        return json.dumps(next((f for f in await ctx.memory.facts() if f["attribute"] == rest), None))
    if cmd == "research":
        topic, _, url = rest.rpartition(" ")
        return await research(ctx, topic, url)
    if cmd == "watch":
        return json.dumps(await watch(ctx))
    if cmd == "checkpoint":
        return json.dumps(await ctx.checkpoint(rest))
    if cmd == "report":
        return json.dumps(_reports())
    return "commands: note, recall, learn, facts, research, watch, checkpoint, report"
