"""A product backend on moorage, written from docs/sdk.md and docs/api.md only: it signs end-users up, hands the
browser an end-user token, runs async turns whose results arrive by signed webhook, shows usage against a cap, runs
code in the user's sandbox and forgets users who leave.

Run: MOORAGE_API_KEY=... python3 examples/backend/app.py (see README.md). Standard library plus the moorage SDK.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from http import cookies
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from moorage import Client
from moorage.client import ApiError, WebhookSignatureError, new_webhook_secret, verify_webhook

HERE = Path(__file__).resolve().parent
AGENT = "notes"
#: What each plan may use per day/month; the server refuses a turn over one with 429 `cap-exceeded`.
PLANS: dict[str, dict[str, float]] = {"trial": {"compute_seconds_per_day": 1}, "free": {"compute_seconds_per_day": 120},
                                      "pro": {"compute_seconds_per_day": 3600}}
WEBHOOK_EVENTS = ["execution.succeeded", "execution.failed", "execution.cancelled"]


class Backend:
    """What the backend keeps: the SDK client, its webhook's secret and the results the webhook delivered."""

    def __init__(self, sdk: Client, public_url: str, state_dir: Path, moorage_public_url: str) -> None:
        self.sdk, self.public_url, self.state_dir = sdk, public_url.rstrip("/"), state_dir
        self.moorage_public_url = moorage_public_url.rstrip("/")
        self.lock = threading.Lock()
        #: execution id -> (user, the event's data), filled by the webhook receiver.
        self.results: dict[str, tuple[str, dict[str, Any]]] = {}
        #: webhook-id of every delivery taken: a retry of one already handled is answered 200 and dropped.
        self.seen: set[str] = set()
        self.secret = ""

    def setup(self) -> None:
        """Deploy the agent and subscribe the webhook (once: a restart finds it by its URL, with the secret kept)."""
        self.sdk.deploy(AGENT, HERE / "agent")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        secret_file = self.state_dir / "webhook-secret"
        url = f"{self.public_url}/hooks/moorage"
        mine = [h for h in self.sdk.paginate(self.sdk.list_webhooks, AGENT) if h["url"] == url]
        if mine and secret_file.exists():
            self.secret = secret_file.read_text().strip()
            return
        for hook in mine:  # subscribed before, but its secret is lost: subscribe again
            self.sdk.delete_webhook(AGENT, hook["id"])
        # Our own secret, written before it is sent: a lost answer cannot cost us the secret.
        self.secret = new_webhook_secret()
        secret_file.write_text(self.secret)
        secret_file.chmod(0o600)
        self.sdk.create_webhook(AGENT, url, events=WEBHOOK_EVENTS, secret=self.secret)

    # -- what the page asks for, for the signed-in user ------------------------------------------------------

    def signup(self, user: str, plan: str) -> dict[str, Any]:
        if plan not in PLANS:
            raise Refused(422, f"no plan {plan!r} (plans: {', '.join(PLANS)})")
        # Get-or-create: safe on every sign-in; the plan's limits replace the stored ones.
        return dict(self.sdk.put_user(AGENT, user, metadata={"plan": plan}, limits=PLANS[plan], provision=True))

    def me(self, user: str) -> dict[str, Any]:
        record = self.sdk.get_user(AGENT, user)
        used = self.sdk.usage(agent=AGENT, user=user, by_day=True)
        # caps: each cap's limit, what is used of it as moorage counts it before a turn, and when it resets.
        return {"user": record["id"], "plan": record.get("metadata", {}).get("plan"), "caps": used.get("caps", {}),
                "instance": record.get("instance"), "usage": {"totals": used["totals"], "days": used.get("days", [])}}

    def token(self, user: str) -> dict[str, Any]:
        issued = self.sdk.issue_user_token(AGENT, user, ttl_s=900)
        return {"token": issued["token"], "expires_at": issued["expires_at"], "agent": AGENT,
                "moorage_url": self.moorage_public_url}

    def ask(self, user: str, message: str, request_id: str) -> dict[str, Any]:
        # The browser's request id is the turn's key: a double click or a retried POST is the same turn.
        ex = self.sdk.invoke_async(AGENT, message, user=user, idempotency_key=f"ask-{user}-{request_id}")
        return {"execution_id": ex["id"], "status": ex["status"]}

    def result(self, user: str, execution_id: str) -> dict[str, Any]:
        with self.lock:
            got = self.results.get(execution_id)
        if got is None or got[0] != user:
            raise Refused(404, f"no result for {execution_id} yet")
        return got[1]

    def run(self, user: str, code: str) -> dict[str, Any]:
        instance = self.sdk.get_user(AGENT, user).get("instance")
        if not instance:
            raise Refused(409, "your sandbox is not there yet (send a message first)")
        r = self.sdk.exec(instance["sandbox_id"], ["python3", "-c", code], timeout_s=30)
        return {"status": r["status"], "exit_code": r["exit_code"], "stdout": r["stdout"], "stderr": r["stderr"]}

    def forget(self, user: str) -> dict[str, Any]:
        gone = self.sdk.delete_user(AGENT, user)
        with self.lock:
            for ex_id in [k for k, (u, _) in self.results.items() if u == user]:
                del self.results[ex_id]
        return {"forgotten": user, "deleted": gone.get("deleted")}

    # -- the webhook receiver ----------------------------------------------------------------------------------

    def receive(self, body: bytes, headers: dict[str, str]) -> int:
        try:
            event = verify_webhook(self.secret, body, headers)  # the raw bytes, as received
        except WebhookSignatureError:
            return 400
        with self.lock:
            if event.id in self.seen:
                return 200  # a retry of a delivery we took: same webhook-id
            self.seen.add(event.id)
            data = event["data"]
            if data.get("execution_id"):
                self.results[data["execution_id"]] = (data["user"], {"type": event["type"], **data})
        return 200


class Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def handler(backend: Backend) -> type[BaseHTTPRequestHandler]:
    page = (HERE / "page.html").read_bytes()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet; errors still go to stderr
            pass

        def _send(self, status: int, body: Any, ctype: str = "application/json", extra: dict[str, str] | None = None) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _user(self) -> str:
            jar = cookies.SimpleCookie(self.headers.get("Cookie") or "")
            if "demo_user" not in jar:
                raise Refused(401, "sign up first (POST /api/signup)")
            return jar["demo_user"].value

        def _route(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if method == "GET" and path == "/":
                    return self._send(200, page, "text/html; charset=utf-8")
                if method == "POST" and path == "/hooks/moorage":
                    status = backend.receive(self._body(), dict(self.headers.items()))
                    return self._send(status, {"ok": status == 200})
                if method == "POST" and path == "/api/signup":
                    body = json.loads(self._body() or b"{}")
                    user = str(body.get("user") or "")
                    if not user:
                        raise Refused(422, "say who you are: {\"user\": \"ada\"}")
                    rec = backend.signup(user, str(body.get("plan") or "free"))
                    return self._send(200, {"user": rec["id"], "plan": rec.get("metadata", {}).get("plan")},
                                      extra={"Set-Cookie": f"demo_user={user}; Path=/; HttpOnly; SameSite=Lax"})
                user = self._user()
                if method == "GET" and path == "/api/me":
                    return self._send(200, backend.me(user))
                if method == "POST" and path == "/api/token":
                    return self._send(200, backend.token(user))
                if method == "POST" and path == "/api/ask":
                    body = json.loads(self._body() or b"{}")
                    rid = str(body.get("request_id") or uuid.uuid4().hex)
                    return self._send(202, backend.ask(user, str(body.get("message") or ""), rid))
                if method == "GET" and path.startswith("/api/results/"):
                    return self._send(200, backend.result(user, path.rsplit("/", 1)[1]))
                if method == "POST" and path == "/api/run":
                    return self._send(200, backend.run(user, str(json.loads(self._body() or b"{}").get("code") or "")))
                if method == "DELETE" and path == "/api/me":
                    return self._send(200, backend.forget(user), extra={"Set-Cookie": "demo_user=; Path=/; Max-Age=0"})
                raise Refused(404, f"no route {method} {path}")
            except Refused as e:
                self._send(e.status, {"error": e.detail})
            except ApiError as e:  # moorage's own words, passed on: detail, what to do next, when to come back
                self._send(e.status if e.status < 500 else 502,
                           {"error": e.detail, "code": e.code, "hint": e.hint, "retry_after": e.retry_after})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler


def main() -> None:
    port = int(os.environ.get("BACKEND_PORT", "8002"))
    public = os.environ.get("BACKEND_PUBLIC_URL", f"http://127.0.0.1:{port}")
    sdk = Client()  # MOORAGE_API_URL (default http://127.0.0.1:7700) and MOORAGE_API_KEY
    backend = Backend(sdk, public, Path(os.environ.get("BACKEND_STATE_DIR", HERE / ".state")),
                      os.environ.get("MOORAGE_PUBLIC_URL", sdk.settings.base_url))
    backend.setup()
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(backend))
    print(f"backend on {public} (moorage at {sdk.settings.base_url})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sdk.close()


if __name__ == "__main__":
    main()
