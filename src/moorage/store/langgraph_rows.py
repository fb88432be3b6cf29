"""How the LangGraph checkpointer's rows hold a thread: its key from a graph's config, the mark of a channel with
no value, a driver's blob as bytes, and the error for a blob-log value gone missing. Shared by langgraph*.py."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig

from moorage.errors import InvalidInput, UnavailableError
from moorage.store.bloblog import BlobGone

# Marks a channel that has a version but no value at that checkpoint (e.g. a DeltaChannel step
# between snapshots): a row is written so the version is known, and it is skipped on load.
_EMPTY = "empty"


def _thread(config: RunnableConfig) -> tuple[str, str]:
    conf = config.get("configurable") or {}
    if conf.get("thread_id") is None:
        raise InvalidInput(
            "a LangGraph config needs configurable.thread_id",
            hint='invoke the graph with config={"configurable": {"thread_id": "..."}}',
        )
    return str(conf["thread_id"]), str(conf.get("checkpoint_ns") or "")


def _bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else bytes(v)


def _damaged(e: BlobGone) -> UnavailableError:
    return UnavailableError(
        f"a checkpoint's channel value is missing from the tenant's blob log ({e})",
        hint="the store's files were changed or damaged outside moorage; restore them from a backup",
    )
