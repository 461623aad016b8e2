"""The packages form layers, and imports run down them.

agentstream -> {pipeline, serving, streams, trainer, deploy, stack} -> {models, schemas, infra}

Within the middle layer only pipeline and serving may import deploy (routing, the checkpoint
follower); trainer and deploy sit side by side and talk through Kafka, never by import.
stack (the one-command stack's embedded servers) imports only infra and schemas, and of the product
packages only agentstream (the CLI, the demos) imports it. bench may use tests/support, not the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYER = {
    "agentstream": 3,
    "pipeline": 2, "serving": 2, "streams": 2, "trainer": 2, "deploy": 2, "stack": 2,
    "models": 1, "infra": 1,
    "schemas": 0,
}
"""A package may import packages of a lower layer; within a layer only itself and the pairs below."""

ALLOWED_SAME_LAYER = {("infra", "schemas"), ("pipeline", "deploy"), ("serving", "deploy")}
ONLY = {"stack": {"infra", "schemas"}}
"""Packages that may import fewer than their layer allows."""
PRODUCT = tuple(LAYER)
SUPPORT = "tests.support"
OTHERS = ("examples", "bench", "tests", SUPPORT)


def imported_modules(path: Path) -> set[str]:
    """Modules a file imports, at any depth of the file (lazy imports count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a module imports."""
    return {name.split(".")[0] for name in imported_modules(path)}


def node_of(module: str) -> str:
    """The graph's node for a module: its top-level package, except tests/support, which is a node of its own."""
    return SUPPORT if module == SUPPORT or module.startswith(SUPPORT + ".") else module.split(".")[0]


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {package: set() for package in (*PRODUCT, *OTHERS)}
    for package in (*PRODUCT, "examples", "bench", "tests"):
        for path in (root / package).rglob("*.py"):
            source = node_of(".".join(path.relative_to(root).with_suffix("").parts))
            graph[source].update({node_of(module) for module in imported_modules(path)} & graph.keys() - {source})
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for package, targets in graph.items():
        if package not in LAYER:
            continue
        for target in targets:
            if target == "examples" and package == "agentstream":
                continue  # the demo runs an example agent; test_only_the_demo_imports_examples keeps it there
            if target in OTHERS or LAYER[target] > LAYER[package] or target not in ONLY.get(package, {target}) or (
                    LAYER[target] == LAYER[package] and (package, target) not in ALLOWED_SAME_LAYER):
                problems.append(f"{package} imports {target}")
    return sorted(problems)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_package_imports_upward():
    assert upward_imports(package_graph()) == []


def test_no_import_cycle_between_packages():
    assert find_cycle(package_graph()) is None


def test_trainer_and_deploy_do_not_import_each_other():
    """The trainer writes checkpoints and deploy decides what serves them: they talk through Kafka only."""
    graph = package_graph()
    assert "deploy" not in graph["trainer"] and "trainer" not in graph["deploy"]
    assert ("trainer", "deploy") not in ALLOWED_SAME_LAYER and ("deploy", "trainer") not in ALLOWED_SAME_LAYER


def test_only_the_demo_imports_examples():
    importers = sorted(str(path.relative_to(ROOT)) for package in PRODUCT for path in (ROOT / package).rglob("*.py")
                       if "examples" in imported_packages(path))
    assert all(name.startswith("agentstream/demo/") for name in importers), importers


def test_bench_imports_only_the_support_of_tests():
    """bench may run the harnesses in tests/support (an HTTP app on a thread), never a test module."""
    assert "tests" not in package_graph()["bench"]


def test_the_runner_side_does_not_need_torch():
    users = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "pipeline").rglob("*.py")
                   if {"torch", "transformers", "models", "serving"} & imported_packages(path))
    assert users == []


def test_the_checks_see_a_violation(tmp_path):
    """The walk is not vacuous: an upward import and a cycle planted in a copy of the layout are found."""
    for package in (*PRODUCT, "examples", "bench", "tests"):
        (tmp_path / package).mkdir()
    (tmp_path / "models" / "bad.py").write_text("def f():\n    from trainer.policy import Policy\n")
    (tmp_path / "trainer" / "ok.py").write_text("import models\n")
    (tmp_path / "serving" / "ok.py").write_text("from deploy.routing import Route\n")
    graph = package_graph(tmp_path)
    assert upward_imports(graph) == ["models imports trainer"]
    assert find_cycle(graph) in (["models", "trainer", "models"], ["trainer", "models", "trainer"])
    (tmp_path / "trainer" / "side.py").write_text("from deploy.gate import Gate\n")
    (tmp_path / "deploy" / "side.py").write_text("import trainer.checkpoints\n")
    assert upward_imports(package_graph(tmp_path)) == ["deploy imports trainer", "models imports trainer",
                                                       "trainer imports deploy"]


def test_the_checks_see_a_misplaced_stack_import(tmp_path):
    """A worker importing an embedded server, the stack importing models, bench importing a test: each is found."""
    for package in (*PRODUCT, "examples", "bench", "tests"):
        (tmp_path / package).mkdir()
    (tmp_path / "tests" / "support").mkdir()
    (tmp_path / "streams" / "bad.py").write_text("from stack.chserver import main\n")
    (tmp_path / "stack" / "bad.py").write_text("import models\n")
    (tmp_path / "agentstream" / "ok.py").write_text("from stack.control import Stack\n")
    (tmp_path / "bench" / "ok.py").write_text("from tests.support.http_thread import ServerThread\n")
    (tmp_path / "bench" / "bad.py").write_text("from tests.unit.test_layers import ROOT\n")
    graph = package_graph(tmp_path)
    assert upward_imports(graph) == ["stack imports models", "streams imports stack"]
    assert graph["bench"] == {"tests", "tests.support"}


def test_the_runner_side_hot_swap_and_model_files_import_without_torch():
    """A runner, the proxy and hot swap (which may point at vLLM) must not need the [train] extra's torch."""
    import subprocess
    import sys

    program = ("import sys, agentstream, pipeline.proxy, pipeline.runner, serving.hotswap, models, models.weights; "
               "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
