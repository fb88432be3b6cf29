"""The agent runtime on the host: deploys agent packages, runs turns in sandboxes, serves guest calls.

``Runtime`` is the facade the API and CLI call; it ties store, lifecycle, sandboxes, memory and LLM together.
"""
