"""The upgrade run's checks: one line each, ``works``, ``refused clearly`` or ``BROKEN`` (with what was seen), and
the report they make."""

from __future__ import annotations

import time
from typing import Any, Callable

WORKS, REFUSED, BROKEN = "works", "refused clearly", "BROKEN"


class Checks:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []  # (section, check, verdict, detail)
        self._section = ""

    def section(self, name: str) -> None:
        self._section = name
        print(f"== {name}", flush=True)

    def _add(self, what: str, verdict: str, detail: str = "") -> None:
        self.rows.append((self._section, what, verdict, detail))
        print(f"{verdict:>15}  {what}" + (f"  ({detail})" if detail else ""), flush=True)

    def works(self, what: str, detail: str = "") -> None:
        self._add(what, WORKS, detail)

    def refused(self, what: str, detail: str) -> None:
        self._add(what, REFUSED, detail)

    def broken(self, what: str, detail: str) -> None:
        self._add(what, BROKEN, detail)

    def check(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``: it returns a detail (works), raises ``Refused`` (refused clearly) or anything else (BROKEN)."""
        try:
            detail = fn()
        except Refused as e:
            self.refused(what, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - a check that fails is a line of the report, not the run's end
            self.broken(what, f"{type(e).__name__}: {e}"[:600])
            return None
        self.works(what, "" if detail is None else str(detail)[:300])
        return detail

    def headline(self) -> str:
        n = {v: sum(1 for r in self.rows if r[2] == v) for v in (WORKS, REFUSED, BROKEN)}
        return f"{n[WORKS]} works, {n[REFUSED]} refused clearly, {n[BROKEN]} BROKEN"

    def markdown(self, *, old: str, new: str, machine: str) -> str:
        out = [f"# Upgrade across versions: {old} (old) → {new} (new, with its working tree)", "",
               f"bench/upgrade/run.py on {machine}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
               f"{self.headline()}.", "",
               "`works`: as on one version. `refused clearly`: a status and a message saying what to do. `BROKEN`: a "
               "5xx, a hang or a silently wrong answer; where the old version is at fault and cannot be changed, "
               "docs/operations.md (\"Rolling upgrade of a fleet\") says so. bench/upgrade/README.md says what each "
               "scenario does.", ""]
        section = None
        for sec, what, verdict, detail in self.rows:
            if sec != section:
                section = sec
                out += ["", f"## {sec}", "", "| check | verdict | detail |", "|---|---|---|"]
            out.append(f"| {what} | {verdict} | {detail.replace('|', '/').replace(chr(10), ' ')} |")
        return "\n".join(out) + "\n"


class Refused(Exception):
    """A check's clear refusal (the status and message the caller got)."""
