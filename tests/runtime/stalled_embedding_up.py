"""`moorage up` whose background embedding never runs: the host a test kills after a reply, before its embedding.

Run as ``python tests/runtime/stalled_embedding_up.py`` with the usual ``MOORAGE_*`` environment. The embedding
queue's thread blocks where it would embed, as a host killed at that moment would; nothing else is changed.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from moorage.memory.episodic import EpisodicMemory  # noqa: E402


def _stalled(self: EpisodicMemory, **_: object) -> int:
    threading.Event().wait()  # never set: the turn's messages stay unembedded until the process dies
    return 0


EpisodicMemory.embed_pending = _stalled  # type: ignore[method-assign]

if __name__ == "__main__":
    from moorage.cli.main import run

    sys.argv = ["moorage", "up"]
    run()
