"""node-agent: torchrun's command line, and ``launch()`` for programs that start jobs themselves.

The API is imported on first use (PEP 562), so that neither the ``node-agent`` command nor a
worker running ``python -m node_agent.api`` pays for it (nor imports it twice).
"""

from __future__ import annotations

# Not ``typing``: a worker's ``from node_agent import worker`` imports this file, and typing
# costs it milliseconds. mypy treats a module-level ``TYPE_CHECKING = False`` as the real one.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .api import (
        ChildFailedError,
        LaunchConfig,
        LaunchError,
        ProcessFailure,
        RendezvousError,
        RendezvousTimeoutError,
        SignalException,
        elastic_launch,
        launch,
        launch_async,
    )

__all__ = [
    "ChildFailedError",
    "LaunchConfig",
    "LaunchError",
    "ProcessFailure",
    "RendezvousError",
    "RendezvousTimeoutError",
    "SignalException",
    "elastic_launch",
    "launch",
    "launch_async",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
