"""MCP test fixtures: the API suite's live server over the real runtime (process sandboxes, real store).

Re-exported from tests/api/conftest.py so both suites run the very same server.
"""

from tests.api.conftest import acme, globex, live_rt, runtime  # noqa: F401 - pytest finds fixtures by name
