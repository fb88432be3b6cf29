"""Usage and caps are tested against a real moorage server (the API suite's fixtures: uvicorn over the real runtime)."""

from tests.api.conftest import acme, globex, live, live_rt, runtime  # noqa: F401  (fixtures)
