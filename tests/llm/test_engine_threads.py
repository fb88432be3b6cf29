"""How many threads the embedded model computes with, and why it matters: llama.cpp's threads meet at a spinning
barrier many times per token, so threads the kernel cannot all run at once stall each other. The default is half
the CPUs this process may use (affinity and cgroup quota); ``llm_threads`` sets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moorage import config as config_mod
from moorage.errors import ConfigError
from moorage.llm import ChatRequest, Message
from moorage.llm._engine import default_threads
from moorage.llm.factory import provider_from_config
from moorage.sandbox import cgroups

#: Loads the model as a host does (default settings) and answers three short questions; prints its thread count
#: and how long the answers took. Run confined to two CPUs.
_TWO_ANSWERS = r"""
import json, time
from moorage.llm._engine import get_engine
engine = get_engine()
body = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
took = []
for i in range(3):
    start = time.monotonic()
    engine.chat(dict(body, messages=[{"role": "user", "content": "Name a harbour, number %d." % i}]))
    took.append(time.monotonic() - start)
print(json.dumps({"threads": getattr(engine, "threads", engine.settings.threads), "took": took}))
"""


def test_two_models_on_two_cpus_answer_promptly_beside_each_other() -> None:
    """Two hosts' models on one machine (or a model beside another llama.cpp server), confined to two CPUs: each
    computes on one thread. With a thread per CPU each, an answer took 2-3 s here, and in one run 60-140 s."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert len(cpus) == 2, "this test needs a machine with two CPUs"
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_ANSWERS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus)) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-2000:]
        got = json.loads(out)
        assert got["threads"] == 1, got  # half of the two CPUs it may use
        # Alone here one answer takes about 1 s; beside the other model, about 2 s. The bound leaves room for a
        # loaded machine and still fails the spinning case by far.
        assert max(got["took"]) < 20, got


def test_a_cgroup_cpu_quota_narrows_the_cpus_a_process_may_use() -> None:
    """A container's ``--cpus`` or a unit's ``CPUQuota``: the affinity lists every CPU, the quota says how many
    may run at once. Here a real cgroup with a one-CPU quota, and one inside it with none of its own: the model's
    threads, the host's worker threads and the weight of its sandboxes' cgroup all count one CPU."""
    control = cgroups.cpu_control()
    assert control.kind, "this test needs a writable cgroup with the cpu controller (run as root)"
    assert len(os.sched_getaffinity(0)) >= 2, "this test needs a machine with two CPUs"
    name = f"test-quota-{uuid.uuid4().hex[:8]}"
    outer = control.create(name, cpus=1.0)
    assert outer is not None
    inner = outer / "inner"
    inner.mkdir()
    code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
            "from moorage.cpus import usable_cpus; from moorage.llm._engine import default_threads;"
            "from moorage.runtime.cpu_share import executor_workers; from moorage.sandbox import cgroups;"
            "print(len(os.sched_getaffinity(0)), usable_cpus(), default_threads(), executor_workers(),"
            " cgroups.group_weight())")
    try:
        for where in (outer, inner):
            r = subprocess.run([sys.executable, "-c", code, str(where)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            affinity, usable, threads, workers, weight = map(int, r.stdout.split())
            assert affinity >= 2 and usable == 1 and threads == 1, (where, r.stdout)
            # The host's worker threads and its sandboxes' weight count the one CPU it may use, too.
            assert workers == 5 and weight == cgroups.SANDBOX_WEIGHT, (where, r.stdout)
    finally:
        for d in (inner, outer):
            assert cgroups.remove_when_empty(d), d
    # Outside it, nothing narrows this test's CPUs.
    assert default_threads() == max(1, min(4, len(os.sched_getaffinity(0)) // 2))


async def test_llm_threads_in_moorage_toml_sets_the_models_threads(tmp_path: Path) -> None:
    toml = tmp_path / "moorage.toml"
    toml.write_text("[moorage]\nllm_threads = 2\n")
    cfg = config_mod.load(toml, env={})
    assert cfg.llm_threads == 2
    provider = provider_from_config(cfg)
    try:
        r = await provider.complete(ChatRequest([Message("user", "Say hello.")], max_tokens=4))
        assert r.usage.output_tokens > 0
        assert provider._engine is not None and provider._engine.threads == 2
    finally:
        await provider.aclose()
    empty = tmp_path / "empty.toml"
    empty.write_text("[moorage]\n")
    assert config_mod.load(empty, env={"MOORAGE_LLM_THREADS": "3"}).llm_threads == 3
    assert config_mod.load(empty, env={}).llm_threads == 0  # 0: half the CPUs
    toml.write_text("[moorage]\nllm_threads = -1\n")
    with pytest.raises(ConfigError, match="llm_threads=-1 is out of range"):
        config_mod.load(toml, env={})
