"""The demo's markdown page names what trained: RL, or the supervised control."""

from pathlib import Path

from agentstream.demo.results import DemoReport, write_markdown


def report(objective: str) -> DemoReport:
    return DemoReport(heldout_before=0.0, heldout_after=0.609, policy_versions=18, seconds=1033.0,
                      training_seconds=600.0, time_to_target_s=None, target=0.85, agent="word-problems",
                      objective=objective, heldout_warm_start=0.469, warm_start_seconds=886.0, budget="600 s")


def test_a_control_runs_page_says_the_control_trained_not_rl(tmp_path: Path) -> None:
    write_markdown(tmp_path / "control.md", report("supervised"))
    page = (tmp_path / "control.md").read_text()
    assert "60.9% after the control" in page and "600 s of the control" in page
    assert "after RL" not in page and "s of RL" not in page


def test_an_rl_runs_page_says_rl_trained(tmp_path: Path) -> None:
    write_markdown(tmp_path / "rl.md", report("policy_gradient"))
    page = (tmp_path / "rl.md").read_text()
    assert "60.9% after RL" in page and "600 s of RL" in page and "the control" not in page
