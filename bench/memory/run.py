"""Memory benchmark: retrieval quality vs BM25-only and dense-only, query latency at 1k/10k/100k events, ingest rate.

Writes bench/results/latest/memory.{md,json}; the last line printed is the headline. Run: .venv/bin/python bench/memory/run.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from moorage.config import Config
from moorage.memory import evalset
from moorage.memory.context import CompactionPolicy, ContextBuilder
from moorage.memory.embeddings import default_embedder, to_bytes
from moorage.memory.episodic import EpisodicMemory
from moorage.memory.evaluate import evaluate
from moorage.store import EventIn, Scope, open_store

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"

# A vocabulary closer to real chat logs than a handful of words: most content words occur in well under
# 1% of events, so full-text postings are as selective as they are in practice.
_PEOPLE = ["dentist", "sister", "landlord", "team", "bank", "manager", "plumber", "gym", "school", "neighbour", "airline",
           "vet", "accountant", "tutor", "pharmacy", "insurer", "mechanic", "builder", "florist", "caterer", "nanny",
           "lawyer", "optician", "courier", "agent", "coach", "barber", "cleaner", "electrician", "doctor"]
_ACTIONS = ["called about", "moved", "cancelled", "confirmed", "asked about", "complained about", "paid for", "rescheduled",
            "forgot", "sent a note about", "booked", "postponed", "approved", "rejected", "updated", "delivered"]
_ADJ = ["blue", "quarterly", "annual", "urgent", "overdue", "weekly", "second", "new", "old", "small", "large", "final",
        "draft", "shared", "private", "late", "early", "monthly", "spare", "broken"]
_NOUNS = ["appointment", "invoice", "delivery", "meeting", "repair", "lease", "trip", "subscription", "refund", "party",
          "interview", "inspection", "class", "order", "contract", "payment", "ticket", "receipt", "quote", "parcel",
          "booking", "checkup", "renewal", "deposit", "estimate", "voucher", "claim", "permit", "visa", "prescription"]
_WHEN = ["on Monday", "next week", "this morning", "in March", "before lunch", "after the holidays", "yesterday", "on Friday",
         "in April", "tonight", "at noon", "on the 14th", "last weekend", "in two weeks"]


def _sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(_PEOPLE)} {rng.choice(_ACTIONS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} "
            f"{rng.choice(_WHEN)}, ref {rng.randint(100, 999)}.")


def _pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.array(xs), p))


def _summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def latency(sizes: list[int], queries: int, seed: int) -> list[dict[str, object]]:
    """Search latency in one user's scope on the SQLite store, with every other scope left empty.

    Vectors: 3,000 distinct sentences are embedded once and reused (each event's vector is that of its
    sentence); the sentences combine subjects, actions, objects and times, so full-text postings vary too.
    """
    rng = random.Random(seed)
    emb = default_embedder()
    pool = sorted({_sentence(rng) for _ in range(3000)})
    vecs = emb.embed(pool)
    qtexts = [f"when did the {rng.choice(_PEOPLE)} {rng.choice(_ACTIONS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)}?"
              for _ in range(queries)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Config(data_dir=Path(tmp)))
        t, _ = store.operator.create_tenant("bench")
        ts = store.tenant(store.operator.principal(t.id))
        t0 = 1_700_000_000.0
        for size in sizes:
            scope = Scope.for_user("bench", f"user{size}")
            for start in range(0, size, 2000):
                batch = []
                for i in range(start, min(size, start + 2000)):
                    j = rng.randrange(len(pool))
                    batch.append(EventIn("message", pool[j], rng.choice(["user", "assistant"]), None, t0 + 60 * i, to_bytes(vecs[j])))
                ts.events.append_many(scope, batch)
            mem = EpisodicMemory(ts, emb)
            c0 = time.perf_counter()
            mem.search(scope, qtexts[0], k=10)  # loads the scope's vectors into this process once
            cold = (time.perf_counter() - c0) * 1000
            row: dict[str, object] = {"events": size, "cold_first_query_ms": cold}
            for name, fn in (
                ("hybrid", lambda q: mem.search(scope, q, k=10)),
                ("lexical_only", lambda q: mem.search_lexical(scope, q, limit=10)),
                ("dense_only", lambda q: mem.search_dense(scope, q, limit=10)),
            ):
                ms, cpu = [], []
                for q in qtexts:
                    c0, s0 = time.process_time(), time.perf_counter()
                    fn(q)
                    ms.append((time.perf_counter() - s0) * 1000)
                    cpu.append((time.process_time() - c0) * 1000)
                # CPU time of the process (all its threads) per query: on a shared host the wall-clock
                # tail mostly measures other people's load; this shows the work the query itself does.
                row[name] = {**_summary(ms), "cpu_p50_ms": _pct(cpu, 50), "cpu_p99_ms": _pct(cpu, 99)}
            results.append(row)
            print(f"  {size:>6} events: hybrid p50 {row['hybrid']['p50_ms']:.1f} ms p99 {row['hybrid']['p99_ms']:.1f} ms", file=sys.stderr)
        store.close()
    return results


def seeds_quality(seeds: list[int]) -> dict[str, object]:
    """recall@k / MRR per system on several generated sets, with mean, standard deviation and paired wins.

    One seed's 60-odd questions move recall@5 by several points from seed to seed, so a single set
    cannot tell a real gain over dense-only from noise; the paired per-seed difference can.
    """
    per_seed = []
    for sd in seeds:
        r = evaluate(evalset.generate(seed=sd)).as_dict()
        per_seed.append({"seed": sd, "systems": r["systems"]})
    metrics = ("recall@1", "recall@5", "recall@10", "mrr")
    mean = {s: {m: statistics.mean(p["systems"][s][m] for p in per_seed) for m in metrics} for s in ("moorage", "bm25", "dense")}
    sd_ = {s: {m: (statistics.stdev(p["systems"][s][m] for p in per_seed) if len(per_seed) > 1 else 0.0) for m in metrics}
           for s in ("moorage", "bm25", "dense")}
    diffs = [p["systems"]["moorage"]["recall@5"] - p["systems"]["dense"]["recall@5"] for p in per_seed]
    return {"seeds": seeds, "per_seed": per_seed, "mean": mean, "stdev": sd_,
            "moorage_minus_dense_recall@5": diffs,
            "moorage_beats_dense_recall@5": sum(d > 0 for d in diffs)}


def ingest(events: int, batch: int, reps: int, seed: int) -> dict[str, float]:
    """Events/s through ``remember_many``: embedding every event plus the store transaction."""
    rng = random.Random(seed)
    emb = default_embedder()
    emb.embed(["warm up"])
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Config(data_dir=Path(tmp)))
        t, _ = store.operator.create_tenant("bench")
        mem = EpisodicMemory(store.tenant(store.operator.principal(t.id)), emb)
        for r in range(reps):
            scope = Scope.for_user("bench", f"ingest{r}")
            texts = [_sentence(rng) for _ in range(events)]
            s0 = time.perf_counter()
            for start in range(0, events, batch):
                mem.remember_many(scope, [EventIn("message", x, "user") for x in texts[start : start + batch]])
            rates.append(events / (time.perf_counter() - s0))
        store.close()
    return {"median_events_per_s": statistics.median(rates), "min": min(rates), "max": max(rates), "reps": reps,
            "events_per_rep": events, "batch": batch}


def context_reuse(turns: int) -> dict[str, object]:
    """Prefix reuse of the context builder vs naive compaction that rewrites one summary in place."""
    sys.path.insert(0, str(ROOT / "tests" / "memory"))
    from session_script import SYSTEM_PROMPT, session, tool_schemas  # the same session the tests drive

    policy = CompactionPolicy(budget_tokens=6144)
    b = ContextBuilder(SYSTEM_PROMPT, tool_schemas(), policy=policy)
    naive = _NaiveContext(b)
    ours, theirs = [], []
    for role, content in session(turns):
        b.add(role, content)
        naive.add(role, content)
        if role != "assistant":
            ours.append(b.build().reused_share)
            theirs.append(naive.build())
    return {
        "turns": turns, "calls": len(ours), "compactions": b.stats.compactions,
        "moorage": {"min_share_after_first": min(ours[1:]), "mean_share": statistics.mean(ours[1:])},
        "naive_rewrite": {"min_share_after_first": min(theirs[1:]), "mean_share": statistics.mean(theirs[1:])},
    }


class _NaiveContext:
    """The common approach: when over the threshold, rewrite one summary of everything older than the last turns."""

    def __init__(self, like: ContextBuilder) -> None:
        self.counter, self.summarizer, self.policy = like.counter, like.summarizer, like.policy
        self.system = like._system
        self.summary = ""
        self.turns: list[tuple[str, str]] = []
        self.prev: list[str] = []

    def add(self, role: str, content: str) -> None:
        self.turns.append((role, content))

    def build(self) -> float:
        tok = lambda t: self.counter.count(t) + self.counter.per_message_overhead  # noqa: E731
        if sum(tok(c) for _, c in self.turns) > self.policy.compact_at_tokens:
            keep = self.turns[-2:]
            old = ([("summary", self.summary)] if self.summary else []) + self.turns[:-2]
            self.summary = self.summarizer.summarize(old, max_tokens=self.policy.summary_max_tokens * 4, counter=self.counter)
            self.turns = keep
        msgs = [self.system.content] + ([self.summary] if self.summary else []) + [c for _, c in self.turns]
        reused = total = 0
        for i, m in enumerate(msgs):
            total += tok(m)
        for i, m in enumerate(msgs):
            if i >= len(self.prev) or self.prev[i] != m:
                break
            reused += tok(m)
        self.prev = msgs
        return reused / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--heldout-seeds", default="7,11,12,13,14,15",
                    help="generator seeds for the multi-seed quality table (fusion was tuned on seeds 1-3 only)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args()
    sizes = [1000, 5000] if args.quick else [int(x) for x in args.sizes.split(",")]
    queries = 30 if args.quick else args.queries

    print("retrieval quality ...", file=sys.stderr)
    ds = evalset.generate(seed=args.seed) if not args.quick else evalset.generate(seed=args.seed, conversations=2)
    quality = evaluate(ds).as_dict()
    print("retrieval quality over held-out seeds ...", file=sys.stderr)
    heldout = seeds_quality([int(x) for x in args.heldout_seeds.split(",")] if not args.quick else [args.seed])
    print("latency ...", file=sys.stderr)
    lat = latency(sizes, queries, args.seed)
    print("ingest ...", file=sys.stderr)
    ing = ingest(300 if args.quick else 1000, 64, 3, args.seed)
    ctx = context_reuse(200)

    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
           "onnxruntime": version("onnxruntime"), "rank_bm25": version("rank-bm25"), "numpy": version("numpy"),
           "sqlite": __import__("sqlite3").sqlite_version}
    result = {"quality": quality, "heldout": heldout, "latency": lat, "ingest": ing, "context": ctx, "env": env,
              "dataset": {"generator_seed": args.seed, "conversations": quality["conversations"], "turns": quality["turns"],
                          "questions": quality["questions"]}}
    q = quality["systems"]
    at10k = next((r for r in lat if r["events"] == 10000), lat[-1])
    h = heldout["mean"]
    headline = (f"memory recall@5 {q['moorage']['recall@5']:.2f} (bm25 {q['bm25']['recall@5']:.2f}, dense {q['dense']['recall@5']:.2f}); "
                f"held-out seeds {h['moorage']['recall@5']:.2f} vs dense {h['dense']['recall@5']:.2f}, "
                f"hybrid ahead on {heldout['moorage_beats_dense_recall@5']}/{len(heldout['seeds'])}; "
                f"query p50 {at10k['hybrid']['p50_ms']:.1f} ms p99 {at10k['hybrid']['p99_ms']:.1f} ms at {at10k['events']} events; "
                f"ingest {ing['median_events_per_s']:.0f} events/s")
    result["headline"] = headline
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "memory.md").write_text(_markdown(result))
    print(headline)


def _markdown(r: dict) -> str:
    q = r["quality"]
    lines = ["# memory benchmark", "",
             f"Dataset: generated (seed {r['dataset']['generator_seed']}): {q['conversations']} conversations, {q['turns']} turns, "
             f"{q['questions']} questions. BM25: rank-bm25 {r['env']['rank_bm25']} (BM25Okapi, lower-cased word tokens).", "",
             "## Retrieval quality", "", "| system | recall@1 | recall@5 | recall@10 | MRR |", "|---|---|---|---|---|"]
    for name, s in q["systems"].items():
        lines.append(f"| {name} | {s['recall@1']:.3f} | {s['recall@5']:.3f} | {s['recall@10']:.3f} | {s['mrr']:.3f} |")
    ho = r["heldout"]
    lines += ["", f"Held-out generator seeds {', '.join(map(str, ho['seeds']))} (fusion tuned on seeds 1-3 only): mean ± sd over seeds", "",
              "| system | recall@1 | recall@5 | recall@10 | MRR |", "|---|---|---|---|---|"]
    for name in ("moorage", "bm25", "dense"):
        m, d = ho["mean"][name], ho["stdev"][name]
        lines.append(f"| {name} | " + " | ".join(f"{m[x]:.3f} ± {d[x]:.3f}" for x in ("recall@1", "recall@5", "recall@10", "mrr")) + " |")
    lines += ["", "moorage − dense recall@5 per seed: " + ", ".join(f"{x:+.3f}" for x in ho["moorage_minus_dense_recall@5"])
              + f" (ahead on {ho['moorage_beats_dense_recall@5']} of {len(ho['seeds'])})"]
    lines += ["", "recall@5 by question type:", "", "| type | moorage | bm25 | dense |", "|---|---|---|---|"]
    for t, per in q["by_type"].items():
        lines.append(f"| {t} ({per['moorage']['questions']}) | " + " | ".join(f"{per[s]['recall@5']:.3f}" for s in ("moorage", "bm25", "dense")) + " |")
    lines += ["", "## Query latency (one user's scope, SQLite store, k=10, incl. embedding the query)", "",
              "| events | hybrid p50 / p99 (min–max) ms | hybrid CPU p50 / p99 ms | lexical-only (store full-text) p50 / p99 ms "
              "| dense-only p50 / p99 ms | dense-only CPU p50 / p99 ms | cold first query ms |",
              "|---|---|---|---|---|---|---|"]
    for row in r["latency"]:
        h, lx, d = row["hybrid"], row["lexical_only"], row["dense_only"]
        lines.append(f"| {row['events']} | {h['p50_ms']:.1f} / {h['p99_ms']:.1f} ({h['min_ms']:.1f}–{h['max_ms']:.1f}) | "
                     f"{h['cpu_p50_ms']:.1f} / {h['cpu_p99_ms']:.1f} | "
                     f"{lx['p50_ms']:.1f} / {lx['p99_ms']:.1f} | {d['p50_ms']:.1f} / {d['p99_ms']:.1f} | "
                     f"{d['cpu_p50_ms']:.1f} / {d['cpu_p99_ms']:.1f} | {row['cold_first_query_ms']:.0f} |")
    i = r["ingest"]
    c = r["context"]
    lines += ["", "## Ingest", "",
              f"{i['median_events_per_s']:.0f} events/s median (min {i['min']:.0f}, max {i['max']:.0f}) over {i['reps']} runs of "
              f"{i['events_per_rep']} events in batches of {i['batch']}, embedding included.", "",
              "## Context prefix reuse (200-turn session)", "",
              "| builder | min share after first call | mean share |", "|---|---|---|",
              f"| moorage (append-only, {c['compactions']} compactions) | {c['moorage']['min_share_after_first']:.3f} | {c['moorage']['mean_share']:.3f} |",
              f"| naive rewrite-summary | {c['naive_rewrite']['min_share_after_first']:.3f} | {c['naive_rewrite']['mean_share']:.3f} |",
              "", f"Environment: {json.dumps(r['env'])}", "", r["headline"], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
