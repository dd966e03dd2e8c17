"""OpenAI-compatible HTTP server over the async engine (``iterserve serve``).

``create_app`` lives in ``iterserve.server.app``; this package imports nothing heavy so
``iterserve serve --help`` stays fast.
"""

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from iterserve.server.app import create_app

        return create_app
    raise AttributeError(name)
