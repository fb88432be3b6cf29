"""Parsing request bodies as JSON with a nesting limit: deep bodies are a 400, never a RecursionError or a 500.

Everything moorage stores or forwards is re-encoded and walked later (journal, state, traces), so a body that
parses but nests deeper than ``MAX_JSON_DEPTH`` is refused at the door rather than failing somewhere inside.
"""

from __future__ import annotations

import json
from typing import Any

from moorage.errors import InvalidInput

#: Deepest nesting of arrays and objects a request body may have; real payloads stay far below it.
MAX_JSON_DEPTH = 64


class JsonTooDeep(InvalidInput):
    code = "json-too-deep"
    http_status = 400


def _too_deep(max_depth: int) -> JsonTooDeep:
    return JsonTooDeep(f"request body nests arrays or objects more than {max_depth} levels deep",
                       hint="flatten the structure; moorage accepts at most this depth")


def depth_exceeds(value: Any, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests deeper than ``max_depth``; iterative, so any depth is safe to ask."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def loads_bounded(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that answers ``JsonTooDeep`` (400) for deep nesting and ``InvalidInput`` for bad JSON."""
    # Cheap pre-check: a body with fewer brackets than the limit cannot be too deep; skip the walk.
    opens = raw.count(b"[" if isinstance(raw, bytes) else "[") + raw.count(b"{" if isinstance(raw, bytes) else "{")
    try:
        value = json.loads(raw)
    except RecursionError as e:
        raise _too_deep(max_depth) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInput(f"request body is not valid JSON: {e}", hint="send a JSON object") from e
    if opens > max_depth and depth_exceeds(value, max_depth):
        raise _too_deep(max_depth)
    return value
