"""Loading a deployed agent inside the sandbox: its moorage.toml, entry module and tools (and the JSON schema of each
tool from its typed signature), with the modules of an earlier version dropped first. Stdlib only."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import typing
from typing import Any, Callable, Dict, List, Optional

try:
    import tomllib
except ImportError:  # pragma: no cover - the guest image ships Python 3.11
    tomllib = None  # type: ignore[assignment]


# -- tools: JSON schema from typed signatures ------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _schema_for(annotation: Any) -> Dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union:
        non_none = [a for a in args if a is not type(None)]
        return _schema_for(non_none[0]) if len(non_none) == 1 else {"anyOf": [_schema_for(a) for a in non_none]}
    if origin in (list, List):
        return {"type": "array", "items": _schema_for(args[0]) if args else {}}
    if origin in (dict, Dict):
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    return {}


def tool_schema(fn: Callable[..., Any]) -> Dict[str, Any]:
    """An OpenAI-style function schema derived from ``fn``'s signature, type hints and docstring."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    props: Dict[str, Any] = {}
    required = []
    for name, p in sig.parameters.items():
        if name in ("ctx", "self") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[name] = _schema_for(hints.get(name, p.annotation))
        if p.default is inspect.Parameter.empty:
            required.append(name)
        else:
            props[name]["default"] = p.default if isinstance(p.default, (str, int, float, bool, type(None))) else None
    doc = inspect.getdoc(fn) or ""
    return {
        "name": fn.__name__,
        "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": props, "required": required},
    }


# -- the loaded agent ------------------------------------------------------------------------------


class LoadedAgent:
    def __init__(self, deployment_id: str, path: str, manifest: Dict[str, Any], module: Any,
                 tools: Dict[str, Callable[..., Any]]) -> None:
        self.deployment_id = deployment_id
        self.path = path
        self.manifest = manifest
        self.module = module
        self.tools = tools
        self.handler = getattr(module, manifest.get("handler", "on_message"), None) if module else None
        #: ``on_wake(ctx)``, run before the first turn or app request after a start or a wake (guest/agent.py).
        hook = getattr(module, "on_wake", None) if module else None
        self.on_wake: Optional[Callable[..., Any]] = hook if callable(hook) else None

    @property
    def tool_schemas(self) -> List[Dict[str, Any]]:
        # Sorted by name: the schemas are part of the stable prompt prefix and must not reorder.
        return [tool_schema(self.tools[n]) for n in sorted(self.tools)]


def _import_file(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError("cannot import %s" % path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: The directories of the agent versions this process imported code from (``load_agent``).
_AGENT_PATHS: List[str] = []


def _under(module: Any, roots: List[str]) -> bool:
    files = [getattr(module, "__file__", None) or ""] + list(getattr(module, "__path__", None) or [])
    return any(f == r or f.startswith(r + os.sep) for f in files if f for r in roots)


def forget_other_versions(path: str) -> None:
    """Before the agent version at ``path`` is imported: the modules of versions loaded before it (its entry, tools
    and its own modules beside them, such as ``helper.py``) leave the process and their directories leave
    ``sys.path``, so the new version's ``import helper`` reads its own file and a module it no longer ships is
    gone. (A redeploy loads the new version into a running sandbox.)"""
    old = [p for p in _AGENT_PATHS if p != path]
    if not old:
        return
    for name, module in list(sys.modules.items()):
        if module is not None and _under(module, old):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in old]
    _AGENT_PATHS[:] = [p for p in _AGENT_PATHS if p not in old]
    importlib.invalidate_caches()


def load_agent(deployment_id: str, path: str) -> LoadedAgent:
    """Import the agent package at ``path`` (its moorage.toml, entry module and tools)."""
    manifest_path = os.path.join(path, "moorage.toml")
    with open(manifest_path, "rb") as f:
        doc = tomllib.load(f)
    manifest = doc.get("agent", {})
    forget_other_versions(path)
    if path not in _AGENT_PATHS:
        _AGENT_PATHS.append(path)
    if path not in sys.path:
        sys.path.insert(0, path)  # sibling imports of the agent's own modules
    prefix = "moorage_agent_%s" % deployment_id.replace("-", "_")
    module = None
    entry = manifest.get("entry")
    if entry:
        module = _import_file(prefix, os.path.join(path, entry))
    tools: Dict[str, Callable[..., Any]] = {}
    for spec in manifest.get("tools", []):
        file, _, fname = spec.partition(":")
        mod = module if (entry and file == entry) else _import_file(prefix + "_" + file.replace(".py", "").replace("/", "_"),
                                                                   os.path.join(path, file))
        fn = getattr(mod, fname, None)
        if not callable(fn):
            raise ImportError("tool %r not found in %s" % (fname, file))
        tools[fname] = fn
    agent = LoadedAgent(deployment_id, path, manifest, module, tools)
    if entry and agent.handler is None:
        raise ImportError(_no_handler(entry, str(manifest.get("handler", "on_message")), module))
    return agent


def _no_handler(entry: str, handler: str, module: Any) -> str:
    """The entry module has no ``handler``: say so, with the functions it does define (a misspelt name, or one the
    manifest should name with ``handler``)."""
    import difflib

    defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
                     and not n.startswith("_"))
    said = "%s has no %s(ctx, message) handler" % (entry, handler)
    if not defined:
        return said + " (define async def %s(ctx, message) in it)" % handler
    close = difflib.get_close_matches(handler, defined, n=1, cutoff=0.6)
    name = close[0] if close else defined[0]
    return said + ": it defines %s (rename %s to %s, or set handler = %r under [agent] in moorage.toml)" % (
        ", ".join(defined[:10]), name, handler, name)
