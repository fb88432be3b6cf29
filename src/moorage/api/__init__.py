"""moorage's HTTP API: JSON routes, SSE streaming, the OpenAI-compatible facade, problem+json errors.

``create_app(runtime_or_store, config)`` returns the Starlette application; nothing here holds business logic.
"""

from moorage.api.app import create_app

__all__ = ["create_app"]
