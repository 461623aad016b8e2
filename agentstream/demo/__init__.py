"""The demos: the only place product code runs an example agent (examples/); their settings are the config's [demo].

``import agentstream`` imports ``settings`` (which adds ``[demo]`` to the configuration), not the demos
themselves: ``run_demo`` and the rest load on first use, so a process that never runs a demo never
imports what they need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentstream.demo.settings import FRAMEWORKS, DemoConfig

if TYPE_CHECKING:
    from agentstream.demo.online import OnlineReport, run_online_demo
    from agentstream.demo.results import DemoReport
    from agentstream.demo.several import SeveralReport, run_several
    from agentstream.demo.training import run_demo

__all__ = ["FRAMEWORKS", "DemoConfig", "DemoReport", "OnlineReport", "SeveralReport", "run_demo", "run_online_demo",
           "run_several"]

_MODULES = {"OnlineReport": "online", "run_online_demo": "online", "DemoReport": "results", "run_demo": "training",
            "SeveralReport": "several", "run_several": "several"}


def __getattr__(name: str) -> Any:
    """The demos' entry points and their reports, imported from their module when first asked for."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"agentstream.demo.{_MODULES[name]}"), name)
