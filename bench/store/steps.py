"""The bench's checkpoint sequence: what each writer puts, step after step."""

from __future__ import annotations

import base64
import os
from typing import Any

from langgraph.checkpoint.base import empty_checkpoint

CHANNELS = ("messages", "context", "plan", "scratch")


class Steps:
    """A graph-like sequence of checkpoints: four channels sharing ``size`` bytes of state.

    mode "full": every step rewrites all four channels (the whole state is new each time);
    mode "one": every step rewrites one channel, as a node that updates one key of the state.
    """

    def __init__(self, size: int, mode: str, seed: int) -> None:
        per = max(1, size // len(CHANNELS))
        rnd = os.urandom(per * 8 + seed % 7)
        self._pool = [base64.b64encode(rnd[i * per:(i + 1) * per]).decode()[:per] for i in range(8)]
        self.mode = mode
        self.step = 0
        self.versions = {c: 0 for c in CHANNELS}
        self.values: dict[str, Any] = {}

    def next(self) -> tuple[dict, dict, dict]:
        changed = CHANNELS if self.mode == "full" or self.step == 0 else (CHANNELS[self.step % len(CHANNELS)],)
        for i, ch in enumerate(changed):
            self.versions[ch] += 1
            self.values[ch] = self._pool[(self.step + i) % len(self._pool)]
        cp = empty_checkpoint()
        cp["channel_values"] = dict(self.values)
        cp["channel_versions"] = dict(self.versions)
        cp["versions_seen"] = {"agent": dict(self.versions)}
        md = {"source": "loop", "step": self.step, "parents": {}}
        self.step += 1
        return cp, md, {ch: self.versions[ch] for ch in changed}
