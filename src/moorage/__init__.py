"""moorage: a self-hosted runtime for persistent, per-user AI agents.

Each end-user gets an agent of their own in its own sandbox; the runtime owns its continuity.
"""

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "__version__"]


def __getattr__(name: str) -> object:
    # The SDK is imported on first use, so `import moorage` (the host, the CLI) stays light.
    if name in ("Client", "AsyncClient"):
        from moorage import client

        return getattr(client, name)
    raise AttributeError(f"module 'moorage' has no attribute {name!r}")
