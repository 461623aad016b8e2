"""The demos: the only place product code runs an example agent (examples/)."""

from agentstream.demo.online import OnlineReport, run_online_demo
from agentstream.demo.training import DemoReport, run_demo

__all__ = ["DemoReport", "OnlineReport", "run_demo", "run_online_demo"]
