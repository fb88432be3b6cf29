"""The CLI's client commands: they talk to a running moorage server through the Python SDK (``moorage.client``).

Server URL and key come from the config (``api_url``/``api_key``, i.e. MOORAGE_API_URL/MOORAGE_API_KEY),
defaulting to where the ``moorage up`` running on the data directory said it serves (else ``host``:``port``) and
the admin key it wrote there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, List, Optional, TypeVar

import typer
from rich.markup import escape
from rich.table import Table

from moorage.cli.console import id_column, make_console, print_table, utc
from moorage.client import Client
from moorage.client import ApiError as SdkError
from moorage.client._local import on_this_machine, server
from moorage.config import Config
from moorage.errors import ConfigError, InvalidInput, MoorageError

console = make_console()
err_console = make_console(stderr=True)
R = TypeVar("R")


def follow(events: Iterable[dict[str, Any]], status: Any, doing: str, name: str, answer: str, *, hint: str) -> Any:
    """The data of a stream's ``answer`` event (a deploy's ``deployment``, a delete's ``deleted``), its ``progress``
    events shown on the way: on the status line (``doing name: step…``), and a line each on stderr when that is no
    terminal (a log). A stream that ends without its answer is an error; ``hint`` says where to look."""
    for ev in events:
        if ev["event"] == "progress":
            step = str(ev["data"].get("message", ""))
            status.update(f"{doing} {name}: {step}…")
            if not err_console.is_terminal:
                err_console.print(f"{name}: {step}", markup=False, highlight=False)
        elif ev["event"] == answer:
            return ev["data"]
    raise ApiError(f"the server ended the stream before it said how {doing} {name} went", hint=hint)


class ApiError(MoorageError):
    """The server answered with a problem; its message and hint are shown as they are."""

    def __init__(self, message: str, *, status: int = 0, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


def _client(cfg: Config) -> Client:
    url, origin = server(cfg)  # as the SDK's Client() finds it (client/_local.py)
    key = cfg.api_key
    if not key:
        path = cfg.data_dir / "local-admin.key"
        if not on_this_machine(url, cfg.data_dir):
            # The local admin key never leaves the machine (as the SDK's Client() keeps it).
            raise ConfigError(f"no API key for {url}",
                              hint="set MOORAGE_API_KEY to a key of that server (this machine's local admin key is "
                                   "sent only to a server on this machine)")
        if not path.exists():
            raise ConfigError("no API key", hint=f"set MOORAGE_API_KEY, or run `moorage up` once to create {path}")
        key = path.read_text().strip()
    client = Client(url, key)
    client.settings = dataclasses.replace(client.settings, url_from=origin)  # said when it cannot be reached
    return client


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """SDK errors shown the CLI's way: the server's title and detail, its hint, nothing else."""
    try:
        yield
    except SdkError as e:
        if e.code == "unreachable":
            raise ConfigError(f"cannot reach the moorage server: {e.detail}",
                              hint="start it with `moorage up` on this data directory, or set MOORAGE_API_URL") from e
        raise ApiError(f"{e.status}: {e.detail}", status=e.status, hint=_traced(_cli_hint(e.hint), e)) from e


def _traced(hint: str | None, e: SdkError) -> str | None:
    """A failure's hint with the command that shows its trace: where a turn failed in the agent's code, what it
    called and when (a server's own failure names its trace id already)."""
    if not e.trace_id or e.status < 500 or e.trace_id in (hint or ""):
        return hint
    shown = f"`moorage trace {e.trace_id}` shows what it did"
    return f"{hint}; {shown}" if hint else shown


#: The server's hints that name a listing route or a query parameter, and what a CLI user does instead: the command
#: that shows the same list; the option that sends the parameter (a key limited to one agent names it on `ps`,
#: `usage` and `logs`).
_LISTINGS = ((re.compile(r"GET /v1/agents/([^/\s]+)/users lists them"), r"`moorage users \1` lists them"),
             (re.compile(r"GET /v1/agents lists them"), "`moorage agents` lists them"),
             (re.compile(r"add agent=(\S+) to the query"), r"pass `--agent \1`"))


def _cli_hint(hint: str | None) -> str | None:
    """The server's hint as a CLI user acts on it: the command that lists what was not found, not its HTTP route;
    the option to pass, not the query parameter to add."""
    for route, command in _LISTINGS:
        hint = route.sub(command, hint) if hint else hint
    return hint


def sdk(cfg: Config, use: Callable[[Client], R], *, hint: Optional[str] = None) -> R:
    """Run ``use`` with an SDK client for the configured server; ``hint`` is what to do next where the server's
    problem says nothing of it (an unknown id: the command that lists them)."""
    try:
        with _client(cfg) as c, _translated():
            return use(c)
    except ApiError as e:
        if hint is None or e.hint or e.status not in (404, 422):  # an unknown id, a value out of range
            raise
        raise ApiError(e.message, status=e.status, hint=hint) from None


def operator_stream(cfg: Config, method: str, path: str, answer: str) -> Iterator[dict[str, Any]]:
    """The events of an operator route's streamed answer (``?stream=true``), sent with the operator token of this
    machine's ``moorage up`` (``<data_dir>/api/operator-token``: never sent to a server elsewhere)."""
    from moorage.client import _transport as tr
    from moorage.client._api import Request

    url, origin = server(cfg)
    token = cfg.data_dir / "api" / "operator-token"
    if not on_this_machine(url, cfg.data_dir):
        raise ConfigError(f"{url} is not a server on this machine",
                          hint="run the command on the moorage host (the operator token stays there)")
    if not token.exists():
        raise ConfigError("no operator token", hint=f"run `moorage up` once to create {token}")
    with Client(url, token.read_text().strip()) as c, _translated():
        c.settings = dataclasses.replace(c.settings, url_from=origin)
        yield from c._events(tr.prepare(Request(method, path, {"stream": "true"},
                                                headers={"accept": "text/event-stream"})), answer_as=answer)


def _pairs(items: list[str]) -> dict[str, str]:
    """``--meta KEY=VALUE`` options as a dict; one without ``=`` (or without a key) is an error, not dropped."""
    bad = [m for m in items if "=" not in m or not m.split("=", 1)[0]]
    if bad:
        raise InvalidInput(f"--meta {bad[0]!r} is not KEY=VALUE", hint="e.g. --meta plan=pro")
    return dict(m.split("=", 1) for m in items)


def _instant(option: str, raw: Optional[str]) -> Optional[float]:
    """A ``--since``/``--until`` value as the seconds since the epoch the API takes: a date is its UTC midnight,
    an ISO-8601 time without an offset is UTC (as the usage's days are), a number is taken as it is."""
    if raw is None:
        return None
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            value = math.nan
        else:
            value = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(value):
        raise InvalidInput(f"{option} {raw!r} is not a date or time",
                           hint=f"e.g. {option} 2026-11-01, {option} 2026-11-01T09:30:00Z or {option} 1793491200")
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _attrs(attrs: Any, width: int = 80) -> str:
    """A span's attributes as ``key=value`` pairs, cut to ``width`` with an ellipsis (``--json`` has them whole), its
    tenant's id left out (the key's own tenant, on every row)."""
    pairs = (f"{k}={_text(v)}" for k, v in (attrs or {}).items() if k != "moorage.tenant")
    text = " ".join(pairs)
    return text if len(text) <= width else text[:width - 1] + "…"


def _outcome(r: Any) -> str:
    """An execution's status and what came of it: the reply, what it waits for (JSON), or why it failed."""
    said = r.get("reply") if r.get("status") != "failed" else (r.get("error") or "no reason recorded")
    said = said if said is not None else r.get("interrupt")
    return f"{r['status']}" + (f" — {_text(said)}" if said not in (None, "") else "")


def _print_turn(r: Any, as_json: bool) -> None:
    """A turn's result: the reply on stdout (its trace id on stderr), or what it waits for and how to answer."""
    if as_json:
        _print(r, True)
    elif r.get("status") == "waiting":
        console.print(f"[yellow]waiting for approval[/] (workflow {r.get('run_id')}): "
                      f"{escape(_text(r.get('interrupt')))}", highlight=False, soft_wrap=True)
        console.print(f"answer with: moorage answer {r.get('run_id')} '<answer>'", highlight=False, soft_wrap=True)
    else:
        console.print(r.get("reply"), highlight=False, markup=False, soft_wrap=True)
        if r.get("trace_id"):
            err_console.print(f"[dim]trace {r['trace_id']}[/]", highlight=False)


def _print(data: Any, as_json: bool, table: Optional[Table] = None) -> None:
    if as_json or table is None:
        print(json.dumps(data, indent=2, default=str))
    else:
        print_table(console, table)


#: ``--agent`` of the commands that read listings spanning agents (a key limited to one agent must name its own).
AGENT = typer.Option(None, "--agent", "-a",
                     help="Only this agent's (a key limited to one agent must name its agent).")
#: What to do next when a sandbox id is unknown.
SANDBOXES = "`moorage ps` lists the instances with their sandbox ids"
#: ``--json`` of the commands that print the API's answer as JSON either way (user, sleep, wake, checkpoint, fork):
#: taken so that a script can pass ``--json`` to every command that shows something.
ALWAYS_JSON = typer.Option(False, "--json", help="The API's answer, as JSON (printed so either way).")
#: ``--json`` of the commands that print text or a table otherwise.
AS_JSON = typer.Option(False, "--json", help="Print the API's answer as JSON (for scripts) instead.")
#: The end-user a turn is for, and the conversation it belongs to.
USER = typer.Option(..., "--user", "-u", help="The end-user, by your product's id for them.")
SESSION = typer.Option(None, "--session", "-s", help="The conversation (default: the user's default session).")


def register(app: typer.Typer, cfg_of: Any) -> None:
    """Attach the client commands to the main app (``cfg_of()`` returns the loaded Config)."""

    @app.command()
    def deploy(path: Path = typer.Argument(..., help="Agent folder (with moorage.toml)."),
               as_json: bool = AS_JSON) -> None:
        """Validate, package and deploy an agent folder; it goes live once its template is built."""
        from moorage.cli.up import tar_dir
        from moorage.runtime.package import load_dir

        pkg = load_dir(path)  # fails fast, locally, with the file and line to fix
        with err_console.status(f"deploying {pkg.name}…") as status:
            def build(c: Client) -> Any:
                # The build's steps on stderr as it goes (a first deploy with packages takes minutes under TCG).
                return follow(c.deploy_stream(pkg.name, tar_dir(path)), status, "deploying", pkg.name, "deployment",
                              hint=f"`moorage agents` shows whether {pkg.name} went live")

            d = sdk(cfg_of(), build)
        _print(d, True) if as_json else console.print(f"[green]deployed[/] {pkg.name} #{d['number']} ({d['id']})")

    @app.command()
    def rollback(agent: str, number: Optional[int] = typer.Option(None, "--to", help="Deployment number (default: previous)."),
                 as_json: bool = AS_JSON) -> None:
        """Make an earlier deployment of an agent live again."""
        d = sdk(cfg_of(), lambda c: c.rollback(agent, number),
                hint="`moorage agents` shows its deployments; `moorage deploy FOLDER` makes a new one")
        _print(d, True) if as_json else console.print(f"{agent} is now at deployment #{d['number']}")

    @app.command()
    def invoke(agent: str, message: str, user: str = USER,
               session: Optional[str] = SESSION,
               as_json: bool = AS_JSON) -> None:
        """Run one turn of an agent for a user and print the reply."""
        _print_turn(sdk(cfg_of(), lambda c: c.invoke(agent, message, user=user, session=session)), as_json)

    @app.command()
    def submit(agent: str, message: str, user: str = USER,
               session: Optional[str] = SESSION,
               wait: bool = typer.Option(False, "--wait", help="Wait for the execution to finish."),
               as_json: bool = AS_JSON) -> None:
        """Run one turn detached (an execution); print its id, or with --wait its outcome."""
        def go(c: Client) -> Any:
            ex = c.invoke_async(agent, message, user=user, session=session)
            return c.wait_execution(ex["id"]) if wait else ex
        r = sdk(cfg_of(), go)
        if as_json:
            _print(r, True)
        else:
            console.print(escape(f"execution {r['id']}: {_outcome(r)}"), highlight=False, soft_wrap=True)
        if r["status"] in ("failed", "cancelled"):
            raise typer.Exit(1)

    @app.command()
    def execution(execution_id: str, as_json: bool = AS_JSON) -> None:
        """Show an execution (async turn): status, reply, what it waits for."""
        r = sdk(cfg_of(), lambda c: c.get_execution(execution_id))
        _print(r, True) if as_json else console.print(escape(_outcome(r)), highlight=False, soft_wrap=True)
        if r["status"] in ("failed", "cancelled"):
            raise typer.Exit(1)

    @app.command()
    def users(agent: str, as_json: bool = AS_JSON,
              meta: list[str] = typer.Option([], "--meta", help="KEY=VALUE metadata filter (repeatable).")) -> None:
        """The end-users of an agent, with their instance's state."""
        filters = _pairs(meta)
        rows = sdk(cfg_of(), lambda c: list(c.paginate(c.list_users, agent, metadata=filters or None)))
        t = Table("user", "instance", "metadata", "limits")
        for u in rows:
            t.add_row(u["id"], (u.get("instance") or {}).get("state", "-"), json.dumps(u.get("metadata")),
                      json.dumps(u.get("limits")))
        _print({"data": rows}, as_json, t)

    @app.command(name="user")
    def put_user(agent: str, user: str,
                 meta: list[str] = typer.Option([], "--meta", help="KEY=VALUE metadata (repeatable)."),
                 provision: bool = typer.Option(False, "--provision", help="Fork the instance now (asleep)."),
                 as_json: bool = ALWAYS_JSON) -> None:
        """Create an end-user of an agent by your own id (or show it; --meta replaces its metadata)."""
        metadata = _pairs(meta) or None
        u = sdk(cfg_of(), lambda c: c.put_user(agent, user, metadata=metadata, provision=provision))
        print(json.dumps(u, indent=2))

    @app.command()
    def answer(run_id: str, text: str, as_json: bool = AS_JSON) -> None:
        """Answer a workflow waiting for a human; it resumes from where it asked (and may ask again)."""
        _print_turn(sdk(cfg_of(), lambda c: c.answer(run_id, text),
                        hint="`moorage invoke` and `moorage submit` print the run id of a turn waiting for approval"),
                    as_json)

    @app.command()
    def chat(agent: str, user: str = USER,
             session: Optional[str] = SESSION) -> None:
        """Interactive terminal chat with an agent as a given user (empty line or Ctrl-D to leave)."""
        cfg = cfg_of()
        try:  # no key, no server, no such agent: said once, before the first prompt, and the command fails
            sdk(cfg, lambda c: c.get_agent(agent))
        except ApiError as e:
            if e.status != 403:  # a key that may invoke but not read agents: its first turn tells
                raise
        console.print(f"chatting with [bold]{agent}[/] as [bold]{user}[/]; empty line to leave")
        while True:
            try:
                text = console.input("[bold]you[/] › ")
            except (EOFError, KeyboardInterrupt):
                break
            if not text.strip():
                break
            with console.status("…"):
                try:
                    r = sdk(cfg, lambda c: c.invoke(agent, text, user=user, session=session))
                except MoorageError as e:
                    console.print(f"[red]{escape(str(e))}[/]")
                    continue
            if r.get("status") == "waiting":
                console.print(f"[bold]{agent}[/] asks › {escape(_text(r.get('interrupt')))}", highlight=False)
                console.print(f"answer with: moorage answer {r.get('run_id')} '<answer>'", highlight=False)
            else:
                console.print(f"[bold]{agent}[/] › {escape(_text(r.get('reply')))}", highlight=False)

    @app.command()
    def ps(as_json: bool = AS_JSON,
           state: Optional[str] = typer.Option(None, "--state", help="only instances in this state (running, "
                                                                     "sleeping, ...)"),
           agent: Optional[str] = AGENT,
           limit: int = typer.Option(200, "--limit", min=1, max=500,
                                     help="most instances shown, the most recently active first")) -> None:
        """Agent instances: state, last activity, RAM and disk (known for instances awake on this host)."""
        import time as _t

        from moorage.lifecycle.machine import InstanceState

        known = [s.value for s in InstanceState]
        if state is not None and state not in known:
            raise InvalidInput(f"--state {state!r} is not an instance state", hint=f"one of {', '.join(known)}")

        fleet = sdk(cfg_of(), lambda c: c.fleet(agent=agent, limit=limit))
        listed = fleet.get("instances", [])
        rows = [i for i in listed if state is None or i.get("state") == state]
        total = sum(fleet.get("counts", {}).values())
        if total > len(listed):  # not every instance: say so, rather than let the table pass for all of them
            err_console.print(f"showing the {len(listed)} most recently active of {total} instances (--limit up to "
                              "500; GET /v1/sandboxes pages through every one)", highlight=False)

        def mib(v: Any) -> str:
            return "-" if v is None else f"{v / (1 << 20):.1f} MiB"

        t = Table(id_column("sandbox"), "instance", "state", "since", "RAM", "disk")  # since its last wake or sleep
        for s in rows:
            ago = _t.time() - float(s.get("last_active") or 0)
            t.add_row(s["id"], s.get("scope", ""), s.get("state", ""), f"{ago:.0f}s ago", mib(s.get("ram_bytes")),
                      mib(s.get("disk_bytes")))
        _print({"data": rows, "counts": fleet.get("counts", {})}, as_json, t)

    def _verb(verb: str, help: str) -> None:
        @app.command(name=verb, help=help)
        def _cmd(sandbox_id: str, as_json: bool = ALWAYS_JSON) -> None:
            print(json.dumps(sdk(cfg_of(), lambda c: c.sandbox_action(sandbox_id, verb), hint=SANDBOXES), indent=2))

    _verb("sleep", "Sleep an agent instance's sandbox.")
    _verb("wake", "Wake an agent instance's sandbox.")

    @app.command(name="checkpoint")
    def _checkpoint(sandbox_id: str, label: Optional[str] = typer.Option(None, "--label", help="the checkpoint's name"),
                    as_json: bool = ALWAYS_JSON) -> None:
        """Checkpoint an end-user's whole instance (sandbox and memory) by its sandbox id."""
        print(json.dumps(sdk(cfg_of(), lambda c: c.sandbox_action(sandbox_id, "checkpoint", label=label),
                             hint=SANDBOXES), indent=2))

    @app.command(name="fork")
    def _fork(sandbox_id: str, to: List[str] = typer.Option(..., "--to", help="a new end-user (repeat for more)"),
              label: Optional[str] = typer.Option(None, "--label", help="a name for the checkpoint taken now to fork "
                                                                         "from"),
              as_json: bool = ALWAYS_JSON) -> None:
        """Fork an end-user's whole instance, as it is now, into new end-users of the same agent."""
        r = sdk(cfg_of(), lambda c: c.sandbox_action(sandbox_id, "fork", label=label, to_users=to), hint=SANDBOXES)
        print(json.dumps(r, indent=2))

    @app.command()
    def forget(agent: str, user: str, yes: bool = typer.Option(False, "--yes", help="Do not ask."),
               as_json: bool = AS_JSON) -> None:
        """Remove everything moorage keeps about one user of an agent (memory, workflows, sandbox, snapshots)."""
        # The question goes to stderr: stdout holds only the answer (with --json, one JSON document).
        if not yes and not typer.confirm(f"forget everything about {user} in {agent}?", err=True):
            raise typer.Exit(1)
        r = sdk(cfg_of(), lambda c: c.delete_user(agent, user))
        _print(r, True) if as_json else console.print(f"forgot {user}: {r.get('removed', 0)} records removed")

    @app.command()
    def trace(trace_id: str, as_json: bool = AS_JSON) -> None:
        """Show one trace's spans as a timeline."""
        data = sdk(cfg_of(), lambda c: c.get_trace(trace_id))
        spans = data.get("spans", [])
        t = Table("span", "start (ms)", "duration (ms)", "status", "attributes")
        t0 = min((s["start_ts"] for s in spans), default=0.0)
        for s in spans:
            dur = ((s.get("end_ts") or s["start_ts"]) - s["start_ts"]) * 1000
            t.add_row(s["name"], f"{(s['start_ts'] - t0) * 1000:.1f}", f"{dur:.1f}", s.get("status", ""),
                      _attrs(s.get("attrs")))
        _print(data, as_json, t)

    @app.command()
    def logs(limit: int = typer.Option(50, "--limit", help="How many spans (1 to 500)."), as_json: bool = AS_JSON,
             agent: Optional[str] = AGENT) -> None:
        """Recent spans of this tenant (turns, model calls, sleeps and wakes), newest first."""
        data = sdk(cfg_of(), lambda c: c.list_spans(limit=limit, agent=agent), hint="pass --limit from 1 to 500")
        t = Table(id_column("trace"), "started", "span", "ms", "status", "attributes")
        for s in data.get("data", []):
            start, end = s.get("start_ts"), s.get("end_ts")
            took = f"{(end - start) * 1000:.1f}" if isinstance(start, (int, float)) and isinstance(end, (int, float)) \
                else ""
            t.add_row(s.get("trace_id", ""), utc(start), s.get("name", ""), took, s.get("status", ""),
                      _attrs(s.get("attrs")))
        _print(data, as_json, t)

    @app.command()
    def usage(as_json: bool = AS_JSON, agent: Optional[str] = AGENT,
              user: Optional[str] = typer.Option(None, "--user", "-u", help="Only this end-user's usage."),
              since: Optional[str] = typer.Option(
                  None, "--since", help="Start of the period, included: a date (UTC midnight), an ISO-8601 time "
                                        "(UTC unless it names an offset) or seconds since the epoch."),
              until: Optional[str] = typer.Option(
                  None, "--until", help="End of the period, excluded (same forms as --since).")) -> None:
        """Tokens, compute and storage used by this tenant (or by one agent or end-user), over a period."""
        start, end = _instant("--since", since), _instant("--until", until)
        if start is not None and end is not None and end < start:
            raise InvalidInput(f"--until {until} is before --since {since}",
                               hint="the period is [--since, --until): give an end later than its start")
        data = sdk(cfg_of(), lambda c: c.usage(agent=agent, user=user, since=start, until=end))
        t = Table("kind", "amount")
        totals = dict(data.get("totals") or {})
        totals.setdefault("cost_usd", data.get("cost_usd", 0.0))
        for k, v in sorted(totals.items()):
            if isinstance(v, (int, float)):
                t.add_row(k, f"{v:,.4f}" if k.endswith("usd") else f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}")
        for name, cap in sorted((data.get("caps") or {}).items()):  # with --agent and --user: as the next turn sees them
            resets = cap.get("resets_at")  # None: a level (store_mib), not a window
            when = f" (resets {utc(resets)})" if isinstance(resets, (int, float)) else ""
            t.add_row(f"cap {name}", f"{cap['used']:,.4g} of {cap['limit']:,.4g}{when}")
        storage = data.get("storage")  # the whole tenant's, under the operator's ceiling
        if isinstance(storage, dict):
            t.add_row("cap tenant_max_storage_mib", f"{storage['used']:,.4g} of {storage['limit']:,.4g}")
        _print(data, as_json, t)

