"""moorage: a self-hosted runtime for persistent, per-user AI agents.

Each end-user gets an agent of their own in its own sandbox; the runtime owns its continuity.
"""

__version__ = "0.1.0"
