"""A training session's bookkeeping of its processes: a process whose work is done can be retired."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentstream.infra.config import load_config
from agentstream.session import Child, ChildFailed, SessionPlan, TrainingSession
from agentstream.stack.control import Endpoints


class ExitedChild(Child):
    """A child whose process has exited with status 0, recording whether it was asked to stop."""

    def __init__(self, name: str, log_path) -> None:
        super().__init__(name, [], {}, log_path)
        self.process = SimpleNamespace(poll=lambda: 0, returncode=0)
        self.stopped = False

    def stop(self, timeout_s: float = 30.0) -> None:
        self.stopped = True


def test_a_retired_process_is_stopped_and_its_exit_is_no_longer_a_failure(tmp_path):
    session = TrainingSession(load_config(environ={}), Endpoints("127.0.0.1:9", "http://127.0.0.1:9"), tmp_path,
                              SessionPlan(agent="m:f", trainer=False))
    trainer = session.children["trainer-a"] = ExitedChild("trainer-a", tmp_path / "trainer-a.log")
    with pytest.raises(ChildFailed, match="trainer-a exited with code 0"):
        session.check()  # a process that exits on its own is a failure of the session
    session.retire("trainer-a")
    assert trainer.stopped and "trainer-a" not in session.children
    session.check()
