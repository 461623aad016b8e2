"""What ``pip install agentstream`` puts into site-packages: one import package, ``agentstream``, and its data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("pipeline", "serving", "models", "schemas", "streams", "trainer", "deploy", "stack", "infra", "examples")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel ``pip wheel .`` builds from this checkout (no network: the build backend is installed)."""
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(folder), str(ROOT)], check=True, capture_output=True, timeout=300,
                   cwd=folder)
    [built] = folder.glob("agentstream-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_top_level_package(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    assert top_level == {"agentstream", next(name for name in top_level if name.endswith(".dist-info"))}
    dist_info = next(name for name in top_level if name.endswith(".dist-info"))
    assert wheel.read(f"{dist_info}/top_level.txt").decode().split() == ["agentstream"]


def test_each_room_is_a_subpackage_with_its_modules_and_data(wheel):
    names = set(wheel.namelist())
    for room in ROOMS:
        assert f"agentstream/{room}/__init__.py" in names, room
    assert {"agentstream/pipeline/sdk.py", "agentstream/trainer/step.py", "agentstream/stack/control.py"} <= names
    assert any(name.startswith("agentstream/schemas/avro/") and name.endswith(".avsc") for name in names)
    assert any(name.startswith("agentstream/infra/migrations/") and name.endswith(".sql") for name in names)
    assert any(name.startswith("agentstream/examples/tasks/") and name.endswith(".jsonl") for name in names)
    assert not any(name.startswith(("agentstream/tests/", "agentstream/bench/")) for name in names)


def test_the_installed_package_runs_outside_the_checkout(wheel, tmp_path):
    """Installed into an empty folder, the wheel adds ``agentstream`` alone, which imports and reads its data there."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    wheel.filename], check=True, capture_output=True, timeout=300)
    packages = sorted(path.name for path in site.iterdir() if path.suffix != ".dist-info" and path.name != "bin")
    assert packages == ["agentstream"]  # bin/ holds the `agentstream` command
    probe = ("import agentstream, agentstream.pipeline.sdk as sdk; from agentstream.schemas import current_schemas; "
             "from agentstream.infra.clickhouse import load_migrations; print(sdk.__file__); "
             "print(len(current_schemas()), len(load_migrations()))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(site)},
                            capture_output=True, text=True, timeout=120, check=True)
    where, counts = result.stdout.split("\n")[:2]
    assert where.startswith(str(site / "agentstream" / "pipeline"))
    assert all(int(count) > 0 for count in counts.split())
