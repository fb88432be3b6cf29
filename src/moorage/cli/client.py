"""The CLI's client commands: they talk to a running moorage server over its HTTP API.

Server URL and key come from the config (``api_url``/``api_key``, i.e. MOORAGE_API_URL/MOORAGE_API_KEY),
defaulting to the local server and the admin key ``moorage up`` wrote in the data directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import httpx
import typer
from rich.console import Console
from rich.table import Table

from moorage.config import Config
from moorage.errors import ConfigError, MoorageError

console = Console()


class ApiError(MoorageError):
    """The server answered with a problem; its message and hint are shown as they are."""


def _client(cfg: Config) -> httpx.Client:
    url = cfg.api_url or f"http://{cfg.host}:{cfg.port}"
    key = cfg.api_key
    if not key:
        path = cfg.data_dir / "local-admin.key"
        if not path.exists():
            raise ConfigError("no API key", hint=f"set MOORAGE_API_KEY, or run `moorage up` once to create {path}")
        key = path.read_text().strip()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)


def call(cfg: Config, method: str, path: str, **kw: Any) -> Any:
    try:
        with _client(cfg) as c:
            r = c.request(method, path, **kw)
    except httpx.ConnectError as e:
        raise ConfigError(f"cannot reach the moorage server: {e}", hint="start it with `moorage up`, or set MOORAGE_API_URL") from e
    if r.status_code >= 400:
        try:
            p = r.json()
            raise ApiError(f"{p.get('title') or r.status_code}: {p.get('detail', '')}".strip(), hint=p.get("hint"))
        except ValueError:
            raise ApiError(f"HTTP {r.status_code}: {r.text[:300]}") from None
    return r.json() if r.content else {}


def _print(data: Any, as_json: bool, table: Optional[Table] = None) -> None:
    if as_json or table is None:
        print(json.dumps(data, indent=2, default=str))
    else:
        console.print(table)


def register(app: typer.Typer, cfg_of: Any) -> None:
    """Attach the client commands to the main app (``cfg_of()`` returns the loaded Config)."""

    @app.command()
    def deploy(path: Path = typer.Argument(..., help="Agent folder (with moorage.toml)."),
               as_json: bool = typer.Option(False, "--json")) -> None:
        """Validate, package and deploy an agent folder; it goes live once its template is built."""
        from moorage.cli.up import tar_dir
        from moorage.runtime.package import load_dir

        pkg = load_dir(path)  # fails fast, locally, with the file and line to fix
        with console.status(f"deploying {pkg.name} (building its template sandbox)…"):
            d = call(cfg_of(), "POST", f"/v1/agents/{pkg.name}/deployments", content=tar_dir(path),
                     headers={"Content-Type": "application/gzip"})
        _print(d, True) if as_json else console.print(f"[green]deployed[/] {pkg.name} #{d['number']} ({d['id']})")

    @app.command()
    def rollback(agent: str, number: Optional[int] = typer.Option(None, "--to", help="Deployment number (default: previous).")) -> None:
        """Make an earlier deployment of an agent live again."""
        d = call(cfg_of(), "POST", f"/v1/agents/{agent}/rollback", json={} if number is None else {"number": number})
        console.print(f"{agent} is now at deployment #{d['number']}")

    @app.command()
    def invoke(agent: str, message: str, user: str = typer.Option(..., "--user", "-u"),
               session: Optional[str] = typer.Option(None, "--session", "-s"),
               as_json: bool = typer.Option(False, "--json")) -> None:
        """Run one turn of an agent for a user and print the reply."""
        body = {"user": user, "message": message, **({"session": session} if session else {})}
        r = call(cfg_of(), "POST", f"/v1/agents/{agent}/invoke", json=body)
        if as_json:
            _print(r, True)
        elif r.get("status") == "waiting":
            console.print(f"[yellow]waiting for approval[/] (workflow {r.get('run_id')}): {json.dumps(r.get('interrupt'))}")
            console.print(f"answer with: moorage answer {r.get('run_id')} '<answer>'")
        else:
            console.print(r.get("reply"), highlight=False)

    @app.command()
    def answer(run_id: str, text: str) -> None:
        """Answer a workflow waiting for a human; it resumes from where it asked."""
        r = call(cfg_of(), "POST", f"/v1/workflows/{run_id}/answer", json={"answer": text})
        console.print(r.get("reply") if r.get("status") == "done" else r, highlight=False)

    @app.command()
    def chat(agent: str, user: str = typer.Option(..., "--user", "-u"),
             session: Optional[str] = typer.Option(None, "--session", "-s")) -> None:
        """Interactive terminal chat with an agent as a given user (empty line or Ctrl-D to leave)."""
        cfg = cfg_of()
        console.print(f"chatting with [bold]{agent}[/] as [bold]{user}[/]; empty line to leave")
        while True:
            try:
                text = console.input("[bold]you[/] › ")
            except (EOFError, KeyboardInterrupt):
                break
            if not text.strip():
                break
            body = {"user": user, "message": text, **({"session": session} if session else {})}
            with console.status("…"):
                try:
                    r = call(cfg, "POST", f"/v1/agents/{agent}/invoke", json=body)
                except MoorageError as e:
                    console.print(f"[red]{e}[/]")
                    continue
            console.print(f"[bold]{agent}[/] › {r.get('reply') if r.get('status') == 'done' else r.get('interrupt')}",
                          highlight=False)

    @app.command()
    def ps(as_json: bool = typer.Option(False, "--json"), state: Optional[str] = typer.Option(None, "--state")) -> None:
        """Agent instances: state, last activity, RAM and disk (known for instances awake on this host)."""
        import time as _t

        fleet = call(cfg_of(), "GET", "/v1/fleet")
        rows = [i for i in fleet.get("instances", []) if state is None or i.get("state") == state]

        def mib(v: Any) -> str:
            return "-" if v is None else f"{v / (1 << 20):.1f} MiB"

        t = Table("sandbox", "instance", "state", "last active", "RAM", "disk")
        for s in rows:
            ago = _t.time() - float(s.get("last_active") or 0)
            t.add_row(s["id"], s.get("scope", ""), s.get("state", ""), f"{ago:.0f}s ago", mib(s.get("ram_bytes")),
                      mib(s.get("disk_bytes")))
        _print({"data": rows, "counts": fleet.get("counts", {})}, as_json, t)

    def _verb(verb: str) -> None:
        @app.command(name=verb, help=f"{verb.capitalize()} an agent instance's sandbox.")
        def _cmd(sandbox_id: str, label: Optional[str] = typer.Option(None, "--label")) -> None:
            r = call(cfg_of(), "POST", f"/v1/sandboxes/{sandbox_id}/{verb}", json={"label": label} if label else {})
            print(json.dumps(r, indent=2))

    for v in ("sleep", "wake", "fork", "checkpoint"):
        _verb(v)

    @app.command()
    def forget(agent: str, user: str, yes: bool = typer.Option(False, "--yes", help="Do not ask.")) -> None:
        """Remove everything moorage keeps about one user of an agent (memory, workflows, sandbox, snapshots)."""
        if not yes and not typer.confirm(f"forget everything about {user} in {agent}?"):
            raise typer.Exit(1)
        r = call(cfg_of(), "DELETE", f"/v1/agents/{agent}/users/{user}")
        console.print(f"forgot {user}: {r.get('removed', 0)} records removed")

    @app.command()
    def trace(trace_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
        """Show one trace's spans as a timeline."""
        data = call(cfg_of(), "GET", f"/v1/traces/{trace_id}")
        spans = data.get("spans", [])
        t = Table("span", "start (ms)", "duration (ms)", "status", "attributes")
        t0 = min((s["start_ts"] for s in spans), default=0.0)
        for s in spans:
            dur = ((s.get("end_ts") or s["start_ts"]) - s["start_ts"]) * 1000
            t.add_row(s["name"], f"{(s['start_ts'] - t0) * 1000:.1f}", f"{dur:.1f}", s.get("status", ""),
                      json.dumps(s.get("attrs", {}))[:80])
        _print(data, as_json, t)

    @app.command()
    def logs(limit: int = typer.Option(50, "--limit"), as_json: bool = typer.Option(False, "--json")) -> None:
        """Recent spans of this tenant (turns, model calls, sleeps and wakes), newest first."""
        data = call(cfg_of(), "GET", "/v1/traces", params={"limit": limit})
        t = Table("trace", "span", "status", "attributes")
        for s in data.get("data", []):
            t.add_row(s.get("trace_id", "")[:12], s.get("name", ""), s.get("status", ""),
                      json.dumps(s.get("attrs", {}))[:80])
        _print(data, as_json, t)

    @app.command()
    def usage(as_json: bool = typer.Option(False, "--json")) -> None:
        """Tokens, compute and storage used by this tenant."""
        data = call(cfg_of(), "GET", "/v1/usage")
        t = Table("kind", "amount")
        for k, v in sorted((data.get("totals") or data).items()):
            if isinstance(v, (int, float)):
                t.add_row(k, f"{v:g}")
        _print(data, as_json, t)

