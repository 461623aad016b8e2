"""What importing the runner side loads: a runner, the proxy and hot swap run without the [train] extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_runner_side_hot_swap_and_model_files_import_without_torch():
    """A runner, the proxy and hot swap (which may point at vLLM) must not need the [train] extra's torch."""
    program = ("import sys, agentstream, agentstream.cli, pipeline.proxy, pipeline.runner, serving.hotswap, models, "
               "models.weights, pipeline.proxy_main, pipeline.runner_main, pipeline.collector_main, "
               "serving.hotswap_main, deploy.gate_main; "
               "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
