"""Example 4: track values from an HTTP API (called with a secret the agent never sees) and show them on a page.

The page is a small HTTP server on port 8080 inside the sandbox, started when the agent is loaded; the host
serves it to the user (and to share links) over the sandbox's channel. Results live on the sandbox's disk,
so they survive sleep and wake. ``tabulate`` comes from requirements.txt, installed when the agent is deployed.
"""

import http.server
import json
import os
import threading
import time

from tabulate import tabulate

RESULTS = "/work/digest/results.json"


def _load():
    try:
        with open(RESULTS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def _save(results):
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results[-50:], f)
    os.replace(tmp, RESULTS)


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        results = _load()
        if self.path.startswith("/results.json"):
            body, ctype = json.dumps(results).encode(), "application/json"
        else:
            rows = [(r["at"], r["url"], json.dumps(r["value"])) for r in reversed(results)]
            table = tabulate(rows, headers=["when", "source", "value"], tablefmt="html")  # cells HTML-escaped
            body = ("<!doctype html><title>digest</title><h1>Tracked values</h1>%s" % table).encode()
            ctype = "text/html; charset=utf-8"
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


threading.Thread(target=_serve, daemon=True, name="digest-page").start()


async def on_message(ctx, message):
    words = message.split()
    if len(words) == 2 and words[0] == "track":
        # The host checks the URL against [agent.egress] and adds API_TOKEN as a header on the way out.
        r = await ctx.fetch(words[1])
        if r["status"] != 200:
            return "the API answered %d" % r["status"]
        value = json.loads(r["body"])
        results = _load()
        results.append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "url": words[1], "value": value})
        _save(results)
        return "tracked %s" % json.dumps(value)
    if message.strip() == "list":
        return "%d values tracked" % len(_load())
    return 'say "track URL" to record a value from the API, or "list"'
