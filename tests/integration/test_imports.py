"""What importing the runner side loads: a runner, the proxy and hot swap run without the [train] extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_runner_side_hot_swap_and_model_files_import_without_torch():
    """A runner, the proxy and hot swap (which may point at vLLM) must not need the [train] extra's torch."""
    modules = ["agentstream", "agentstream.cli", "agentstream.pipeline.proxy.server",
               "agentstream.pipeline.runner.pool", "agentstream.serving.hotswap", "agentstream.models",
               "agentstream.models.weights", "agentstream.pipeline.proxy.main", "agentstream.pipeline.runner.main",
               "agentstream.pipeline.collector.main", "agentstream.serving.hotswap_main",
               "agentstream.deploy.gate_main"]
    program = (f"import sys, {', '.join(modules)}; "
               "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
