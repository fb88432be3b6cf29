"""The examples run on the same real runtime fixture as tests/runtime."""

from tests.runtime.conftest import Env, env  # noqa: F401  (re-exported fixture)
