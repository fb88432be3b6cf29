"""Throughput by writer count: each contender's puts/s at 1 to 64 writer threads, and each one's best.

The throughput cells (run.py) compare both savers at the same writer count. This sweep shows where each one
peaks on this host and what its best rate is: a saver that commits every put on its own connection is bound by
CPU once its connections use the cores, while group commit is bound by commit latency until enough writers queue
for large batches. Both views are reported; neither replaces the other.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from contenders import Contender, versus
from report import section, table_head

#: Writer threads per level of the sweep.
SCALING_LEVELS = (1, 2, 4, 8, 16, 32, 64)
#: The state the sweep writes (a subset of the cells: the smallest state is where commit latency weighs most).
SCALING_SIZE, SCALING_MODE = "1KiB", "full"
#: Puts per sample, split across the writers (at least ``_MIN_PER_WRITER`` each).
SCALING_PUTS = 2400
_MIN_PER_WRITER = 20

#: ``measure(contender, tag, writers, puts_per_writer) -> puts/s``.
Measure = Callable[[Contender, str, int, int], float]


def sweep(group: Sequence[Contender], measure: Measure, prepare: Callable[[], None], levels: Sequence[int],
          puts: int, rounds: int, warm_rounds: int) -> list[dict[str, Any]]:
    """Median puts/s of ``rounds`` samples per contender of ``group`` (moorage first, its peer second) at each
    writer count of ``levels``, alternating as the cells do, after ``warm_rounds`` unmeasured rounds;
    ``prepare`` puts every contender back in its starting state before each level."""
    backend = group[0].backend
    out = []
    for w in levels:
        per_w = max(_MIN_PER_WRITER, puts // w)
        prepare()
        for rnd in range(warm_rounds):
            for c in (group if rnd % 2 == 0 else group[::-1]):
                measure(c, f"swarm{w}r{rnd}-{backend}-{c.name}", w, per_w)
        samples: dict[str, list[float]] = {c.name: [] for c in group}
        for rnd in range(rounds):
            for c in (group if rnd % 2 == 0 else group[::-1]):
                samples[c.name].append(measure(c, f"sweep{w}r{rnd}-{backend}-{c.name}", w, per_w))
        row = versus(samples, backend=backend, size=SCALING_SIZE, mode=SCALING_MODE, writers=w, puts=puts,
                     puts_per_writer=per_w)
        print(f"scaling {backend:8s} {SCALING_SIZE} {SCALING_MODE} {w:2d} writers: moorage {row['moorage_per_s']:.0f} "
              f"puts/s, {row['peer']} {row['peer_per_s']:.0f} ({row['ratio']:.2f}x)", flush=True)
        out.append(row)
    return out


def peaks(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per backend: each contender's best median and the writer count it was reached at, and their ratio."""
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        m = max(mine, key=lambda r: r["moorage_per_s"])
        p = max(mine, key=lambda r: r["peer_per_s"])
        out[backend] = {"peer": p["peer"], "moorage_per_s": m["moorage_per_s"], "moorage_writers": m["writers"],
                        "peer_per_s": p["peer_per_s"], "peer_writers": p["writers"],
                        "ratio": m["moorage_per_s"] / p["peer_per_s"]}
    return out


def scaling_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's section for the sweep."""
    if not rows:
        return []
    levels = sorted({r["writers"] for r in rows})
    backends = {r["backend"]: r["peer"] for r in rows}
    lines = section(f"Scaling: puts/s by writer threads ({SCALING_SIZE} `{SCALING_MODE}`), and each saver's best",
                    f"The same savers and setup as the throughput cells, {rows[0]['puts']} puts per sample split across "
                    f"the writers (at least {_MIN_PER_WRITER} each); median of the rounds, alternating, after warm-up "
                    "rounds; every level starts from settled files and a fresh peer pool. The cells above compare at "
                    "equal writer counts; here each saver's best rate over all the counts is compared too (capacity on "
                    "this host).",
                    ["writers"] + [c for b, peer in backends.items() for c in (f"{b} moorage", peer, "ratio")])
    for w in levels:
        cells = []
        for backend in backends:
            r = next((x for x in rows if x["backend"] == backend and x["writers"] == w), None)
            cells.append(f"{r['moorage_per_s']:.0f} | {r['peer_per_s']:.0f} | {r['ratio']:.2f}x" if r else "- | - | -")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", *table_head(["backend", "moorage best (writers)", "peer best (writers)", "best / best"])]
    for backend, pk in peaks(rows).items():
        lines.append(f"| {backend} | {pk['moorage_per_s']:.0f} ({pk['moorage_writers']}) | {pk['peer_per_s']:.0f} "
                     f"({pk['peer']}, {pk['peer_writers']}) | {pk['ratio']:.2f}x |")
    return lines


def scaling_headline(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    levels = sorted({r["writers"] for r in rows})
    return (f"best puts/s over {levels[0]}-{levels[-1]} writers ({SCALING_SIZE} {SCALING_MODE}), moorage/peer: "
            + ", ".join(f"{b} {pk['moorage_per_s']:.0f}/{pk['peer_per_s']:.0f} = {pk['ratio']:.2f}x"
                        for b, pk in peaks(rows).items()))
