"""The packages form layers, imports run down them, and no module imports itself back through others.

The rooms (``pipeline/``, ``schemas/``, ...) are top-level folders of the repository and subpackages of the
one import package, ``agentstream`` (``agentstream/pipeline`` links to ``../pipeline``): code imports
``agentstream.pipeline.sdk``, never ``pipeline.sdk``. The checks below name a room's modules by their path
in the repository (``pipeline.sdk``), so an import is read with its ``agentstream.`` prefix dropped.

agentstream -> {pipeline, serving, streams, trainer, deploy, stack} -> {models, schemas, infra}

Within the middle layer only pipeline and serving may import deploy (routing, the checkpoint
follower); trainer and deploy sit side by side and talk through Kafka, never by import. In the
bottom layer models may import infra (local files and their digests), never the other way.
stack (the one-command stack's embedded servers) imports only infra and schemas, and of the product
packages only agentstream (the CLI, the demos) imports it. bench may use tests/support, not the tests, and
nothing under tests/ imports bench: what the two share (scenario parts, the span ledger) lives in tests/support.

The same rules hold for each module, and the modules of the product form no circle, within a
package or across packages. An edge of the module graph is an import as written, anywhere in
the file (a lazy import in a function and one under ``TYPE_CHECKING`` count):

* ``import a.b.c`` is an edge to the module ``a.b.c``;
* ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, otherwise to ``a.b``
  (the package's ``__init__``);
* a relative import is resolved against the importing module's package first.

The ``__init__`` modules of the packages above a named module (``a`` and ``a.b`` for
``import a.b.c``) are not edges, though Python runs them first: a module depends on the module it
names, and counting the chain would put every package whose ``__init__`` re-exports its
submodules (``schemas``, ``models``, ``pipeline.publisher``) in a circle with each submodule that
imports a sibling by its full name. A module that names its own package's ``__init__``
(``from schemas import X`` inside ``schemas/``) is an edge and is checked.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYER = {
    "agentstream": 3,
    "pipeline": 2, "serving": 2, "streams": 2, "trainer": 2, "deploy": 2, "stack": 2,
    "models": 1, "infra": 1,
    "schemas": 0,
}
"""A package may import packages of a lower layer; within a layer only itself and the pairs below."""

ALLOWED_SAME_LAYER = {("infra", "schemas"), ("models", "infra"), ("pipeline", "deploy"), ("serving", "deploy")}
ONLY = {"stack": {"infra", "schemas"}}
"""Packages that may import fewer than their layer allows."""
PRODUCT = tuple(LAYER)
SUPPORT = "tests.support"
OTHERS = ("examples", "bench", "tests", SUPPORT)
ROOMS = (*PRODUCT[1:], "examples")
"""The folders that an install exposes as subpackages of ``agentstream``."""


def in_repository_terms(module: str) -> str:
    """``agentstream.pipeline.sdk`` is the module at ``pipeline/sdk.py``: the name the checks use for it."""
    head, _, rest = module.partition(".")
    return rest if head == "agentstream" and rest.split(".")[0] in ROOMS else module


def imported_modules(path: Path) -> set[str]:
    """Modules a file imports, at any depth of the file (lazy imports count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(in_repository_terms(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(in_repository_terms(node.module))
    return found


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a module imports."""
    return {name.split(".")[0] for name in imported_modules(path)}


def node_of(module: str) -> str:
    """The graph's node for a module: its top-level package, except tests/support, which is a node of its own."""
    return SUPPORT if module == SUPPORT or module.startswith(SUPPORT + ".") else module.split(".")[0]


def package_files(root: Path, package: str) -> list[Path]:
    """The Python files of a top-level folder; ``agentstream``'s links to the rooms are the rooms' own files."""
    return [path for path in (root / package).rglob("*.py")
            if package != "agentstream" or path.relative_to(root / package).parts[0] not in ROOMS]


def module_name(path: Path, root: Path = ROOT) -> str:
    """``a/b/c.py`` is ``a.b.c``; ``a/b/__init__.py`` is ``a.b``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the product packages, by its dotted name."""
    return {module_name(path, root): path for package in PRODUCT for path in package_files(root, package)}


def module_imports(path: Path, name: str, known: Mapping[str, Path]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (at ``path``) imports, by the rule in this file's docstring."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(in_repository_terms(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = in_repository_terms(node.module or "")
            if node.level:
                parents = package.split(".")
                base = ".".join([*parents[:len(parents) - node.level + 1], *([node.module] if node.module else [])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return (found & known.keys()) - {name}


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The product's modules and the product modules each imports."""
    modules = product_modules(root)
    return {name: module_imports(path, name, modules) for name, path in modules.items()}


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {package: set() for package in (*PRODUCT, *OTHERS)}
    for package in (*PRODUCT, "examples", "bench", "tests"):
        for path in package_files(root, package):
            source = node_of(".".join(path.relative_to(root).with_suffix("").parts))
            graph[source].update({node_of(module) for module in imported_modules(path)} & graph.keys() - {source})
    return graph


def forbidden(package: str, target: str) -> bool:
    """Whether product package ``package`` may not import ``target`` (another package, or a node of OTHERS)."""
    if target == "examples" and package == "agentstream":
        return False  # the demo runs an example agent; test_only_the_demo_imports_examples keeps it there
    return target in OTHERS or LAYER[target] > LAYER[package] or target not in ONLY.get(package, {target}) or (
        LAYER[target] == LAYER[package] and (package, target) not in ALLOWED_SAME_LAYER)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{package} imports {target}" for package, targets in graph.items() if package in LAYER
                  for target in targets if forbidden(package, target))


def upward_module_imports(graph: dict[str, set[str]]) -> list[str]:
    """The same rule for the module graph, naming the modules (a module may import its own package's)."""
    return sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                  if node_of(module) != node_of(target) and forbidden(node_of(module), node_of(target)))


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


def test_no_module_imports_upward():
    assert upward_module_imports(module_graph()) == []


def test_no_import_cycle_between_modules():
    """No circle anywhere: not across packages, not inside one."""
    assert find_cycle(module_graph()) is None


def test_the_module_graph_sees_the_process_mains():
    """The walk reads the real tree: the CLI's lazy imports of each process's main are edges."""
    graph = module_graph()
    cli = set().union(*(targets for module, targets in graph.items() if module.startswith("agentstream.cli.")))
    assert {"pipeline.proxy.main", "trainer.worker_main", "deploy.gate_main"} <= cli
    assert "agentstream.cli" not in graph["agentstream.cli.schema_registry"]


def test_trainer_and_deploy_do_not_import_each_other():
    """The trainer writes checkpoints and deploy decides what serves them: they talk through Kafka only."""
    graph = package_graph()
    assert "deploy" not in graph["trainer"] and "trainer" not in graph["deploy"]
    assert ("trainer", "deploy") not in ALLOWED_SAME_LAYER and ("deploy", "trainer") not in ALLOWED_SAME_LAYER


def test_only_the_demo_imports_examples():
    importers = sorted(str(path.relative_to(ROOT)) for package in PRODUCT for path in package_files(ROOT, package)
                       if "examples" in imported_packages(path))
    assert all(name.startswith("agentstream/demo/") for name in importers), importers


def test_bench_imports_only_the_support_of_tests():
    """bench may run the harnesses in tests/support (an HTTP app on a thread), never a test module."""
    assert "tests" not in package_graph()["bench"]


def bench_imports_in_tests(root: Path = ROOT) -> list[str]:
    """The files under tests/ (support included) that import bench, and what they import of it."""
    return sorted(f"{path.relative_to(root)} imports {name}" for path in package_files(root, "tests")
                  for name in imported_modules(path) if name.split(".")[0] == "bench")


def test_nothing_under_tests_imports_bench():
    """Tests and benches share harnesses through tests/support; a test never runs a bench's module."""
    assert bench_imports_in_tests() == []
    graph = package_graph()
    assert "bench" not in graph["tests"] and "bench" not in graph["tests.support"]


def test_the_bench_check_sees_a_test_importing_bench(tmp_path):
    for package in (*PRODUCT, "examples", "bench", "tests"):
        (tmp_path / package).mkdir()
    (tmp_path / "tests" / "support").mkdir()
    (tmp_path / "tests" / "integration").mkdir()
    (tmp_path / "tests" / "integration" / "bad.py").write_text("from bench.scenario import publish\n")
    (tmp_path / "tests" / "support" / "bad.py").write_text("def f():\n    import bench.gate\n")
    (tmp_path / "tests" / "integration" / "ok.py").write_text("from tests.support.deploy_scenario import publish\n")
    (tmp_path / "bench" / "ok.py").write_text("from tests.support.gate_simulation import simulate_canaries\n")
    assert bench_imports_in_tests(tmp_path) == ["tests/integration/bad.py imports bench.scenario",
                                                "tests/support/bad.py imports bench.gate"]
    graph = package_graph(tmp_path)
    assert graph["tests"] == {"bench", "tests.support"} and graph["tests.support"] == {"bench"}


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


def test_the_module_checks_see_a_circle_inside_a_package_and_an_upward_import(tmp_path):
    """Two modules of one package importing each other (one lazily, one relatively) are a circle the package
    graph cannot see; a module importing a module of a higher layer is named."""
    for package in (*PRODUCT, "examples", "bench", "tests"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "a.py").write_text("from pipeline import b\n")
    (tmp_path / "pipeline" / "b.py").write_text("def f():\n    from .a import g\n")
    assert find_cycle(package_graph(tmp_path)) is None
    assert find_cycle(module_graph(tmp_path)) == ["pipeline.a", "pipeline.b", "pipeline.a"]
    (tmp_path / "pipeline" / "b.py").write_text("")
    (tmp_path / "trainer" / "policy.py").write_text("")
    (tmp_path / "models" / "bad.py").write_text("def f():\n    from trainer.policy import Policy\n")
    graph = module_graph(tmp_path)
    assert upward_module_imports(graph) == ["models.bad imports trainer.policy"]
    assert find_cycle(graph) is None


def test_a_package_init_re_exporting_its_modules_is_no_circle(tmp_path):
    """The rule of the docstring: ``import schemas.errors`` is no edge to ``schemas/__init__``; naming it is."""
    for package in PRODUCT:
        (tmp_path / package).mkdir()
    (tmp_path / "schemas" / "__init__.py").write_text("from .codec import Codec\nfrom schemas.errors import Bad\n")
    (tmp_path / "schemas" / "errors.py").write_text("")
    (tmp_path / "schemas" / "codec.py").write_text("import schemas.errors\nfrom schemas import errors\n")
    graph = module_graph(tmp_path)
    assert graph["schemas"] == {"schemas.codec", "schemas.errors"}
    assert graph["schemas.codec"] == {"schemas.errors"}
    assert find_cycle(graph) is None
    (tmp_path / "schemas" / "codec.py").write_text("from schemas import Bad\n")
    assert find_cycle(module_graph(tmp_path)) == ["schemas", "schemas.codec", "schemas"]


def old_top_level_imports(root: Path = ROOT) -> list[str]:
    """Imports that name a room as a top-level package (``from pipeline.sdk import x``): an install has no such name."""
    found = []
    for package in (*PRODUCT, "examples", "bench", "tests"):
        for path in package_files(root, package):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                found += [f"{path.relative_to(root)} imports {name}" for name in names if name.split(".")[0] in ROOMS]
    return sorted(found)


def test_every_import_of_a_room_goes_through_agentstream():
    assert old_top_level_imports() == []


def test_each_room_is_a_subpackage_of_agentstream():
    """``agentstream/<room>`` is the room's folder, so the checkout imports what a wheel installs."""
    for room in ROOMS:
        assert (ROOT / "agentstream" / room).resolve() == ROOT / room, room


def test_the_old_name_check_sees_one(tmp_path):
    for package in (*PRODUCT, "examples", "bench", "tests"):
        (tmp_path / package).mkdir()
    (tmp_path / "trainer" / "bad.py").write_text("from models.loading import load\nimport agentstream.models\n")
    (tmp_path / "bench" / "bad.py").write_text("def f():\n    import schemas.codec\n")
    assert old_top_level_imports(tmp_path) == ["bench/bad.py imports schemas.codec",
                                               "trainer/bad.py imports models.loading"]


PIPELINE_ARROWS = {
    "sdk": set(),
    "publisher": {"sdk"},
    "proxy": {"sdk", "publisher"},
    "collector": {"sdk", "publisher"},
    "runner": {"sdk", "publisher", "proxy.access"},
}
"""The rooms inside ``pipeline/`` and what each may import of the others: the SDK at the bottom, the publisher
above it, the three processes (proxy, collector, runner) on top and apart; the runner mints the proxy's feedback
tokens with ``proxy.access`` and imports nothing else of the proxy."""


def pipeline_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 else None


def pipeline_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports between ``pipeline/``'s rooms that PIPELINE_ARROWS does not allow."""
    found = []
    for module, targets in graph.items():
        room = pipeline_room(module)
        for target in targets:
            other = pipeline_room(target)
            if room and other and other != room:
                allowed = PIPELINE_ARROWS.get(room, set())
                if other not in allowed and ".".join(target.split(".")[1:3]) not in allowed:
                    found.append(f"{module} imports {target}")
    return sorted(found)


def test_the_rooms_of_the_pipeline_import_down_only():
    rooms = {pipeline_room(module) for module in module_graph()} - {None}
    assert rooms == set(PIPELINE_ARROWS)
    assert pipeline_crossings(module_graph()) == []


def test_the_pipeline_check_sees_a_crossing(tmp_path):
    for package in PRODUCT:
        (tmp_path / package).mkdir()
    for room in ("proxy", "collector", "runner"):
        (tmp_path / "pipeline" / room).mkdir()
        for name in ("__init__", "server", "access", "receiver", "pool"):
            (tmp_path / "pipeline" / room / f"{name}.py").write_text("")
    (tmp_path / "pipeline" / "runner" / "pool.py").write_text(
        "from agentstream.pipeline.proxy.access import feedback_token\nimport agentstream.pipeline.proxy.server\n")
    (tmp_path / "pipeline" / "collector" / "receiver.py").write_text("from agentstream.pipeline.proxy import access\n")
    assert pipeline_crossings(module_graph(tmp_path)) == ["pipeline.collector.receiver imports pipeline.proxy.access",
                                                          "pipeline.runner.pool imports pipeline.proxy.server"]
