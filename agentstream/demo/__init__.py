"""The demos: the only place product code runs an example agent (examples/)."""

from agentstream.demo.training import DemoReport, run_demo

__all__ = ["DemoReport", "run_demo"]
