"""Async turns and their webhooks are tested against a real server too (the API suite's fixtures)."""

from tests.api.conftest import acme, globex, live, live_rt, runtime

__all__ = ["acme", "globex", "live", "live_rt", "runtime"]
