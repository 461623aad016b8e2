"""`agentstream dashboard` in a real browser (headless Chromium via Playwright) over data from a real short run.

A short `agentstream train` on the tiny model (an agent with a plan span, two LLM calls, an
intermediate reward, and held-out tasks it opts out of training) fills a database; the dashboard
serves it; each page must draw charts with non-empty series, and the rollout view must show the
rollout's span count and reward as ClickHouse has them. Screenshots go to test-output/dashboard/.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agentstream.dashboard import queries
from agentstream.dashboard.readonly_client import Warehouse, WarehouseError
from agentstream.infra.clickhouse import migrate
from agentstream.infra.processes import free_port
from tests.support.streams_harness import worker_env

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MAX_TOKENS = 8
CONFIG = """
[topics]
partitions = 1

[streams]
grace_s = 0.2
session_timeout_s = 3

[trainer]
device = "cpu"
threads = 1
lr = 0.003
batch_transitions = 16
batch_tokens = 0
batch_wait_s = 3
checkpoint_every_steps = 1
session_timeout_s = 3
"""

DASHBOARD_KEY = "dashboard-key-for-tests"

_clients: list = []


async def planning_agent(task: dict, rollout) -> float:
    """Two chat calls under a plan span, an intermediate reward between them; held-out tasks opt out of training."""
    from openai import AsyncOpenAI

    from agentstream.pipeline.sdk import emit_reward, span

    if not _clients:
        _clients.append(AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0))
    client = _clients[0].with_options(base_url=rollout.llm_base_url())
    attributes = {"agentstream.train": False} if task.get("heldout") else {}
    with span("plan", **attributes):
        texts = []
        for turn in range(2):
            completion = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"{task['prompt']} (turn {turn})"}],
                max_tokens=MAX_TOKENS, temperature=1.0)
            texts.append(completion.choices[0].message.content or "")
            if turn == 0:
                emit_reward(sum(c.isalpha() for c in texts[0]) / MAX_TOKENS / 2)
    return sum(c.isalpha() for c in texts[1]) / MAX_TOKENS


@pytest.fixture(scope="module")
def run(tmp_path_factory, stack):
    """A database filled by a real `agentstream train` run: 5 trained tasks and 1 held-out task, 4 rollouts each."""
    tmp_path = tmp_path_factory.mktemp("dashboard")
    tag = uuid.uuid4().hex[:8]
    database = f"dash_{tag}"
    env = worker_env(tmp_path, stack, f"dash{tag}.", database, CONFIG)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Task {i}: write letters.", "heldout": i == 5})
                             + "\n" for i in range(6)))
    result = subprocess.run(
        [sys.executable, "-m", "agentstream", "train", "--agent", "tests.integration.test_dashboard:planning_agent",
         "--tasks", str(tasks), "--model", "tiny", "--group-size", "4", "--concurrency", "8"],
        env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield env, database


def start_dashboard(env: dict[str, str], headers: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`agentstream dashboard` on a free port, once its health check answers (with ``headers``)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "agentstream", "dashboard", "--port", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 30
    while True:
        try:
            request = urllib.request.Request(url + "api/health", headers=headers or {})
            with urllib.request.urlopen(request, timeout=2) as response:
                assert json.load(response)["ok"]
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the dashboard did not answer: {process.communicate()[0][-2000:]}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def dashboard(run):
    env, _database = run
    process, url = start_dashboard(env)
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def keyed_dashboard(run):
    """The same dashboard with ``[security] dashboard_keys`` set."""
    env, _database = run
    process, url = start_dashboard({**env, "AGENTSTREAM_DASHBOARD_KEYS": f"other-key,{DASHBOARD_KEY}"},
                                   {"Authorization": f"Bearer {DASHBOARD_KEY}"})
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (`make install` installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


def open_page(browser, url: str, route: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("requestfailed", lambda request: errors.append(f"failed: {request.url}"))
    page.goto(f"{url}#{route}")
    page.wait_for_selector(f"body[data-loaded='{route}']", timeout=15_000)
    assert not errors, errors
    assert page.get_attribute("body", "data-error") is None
    return page


def chart_points(page) -> dict[str, int]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('section.panel')]
        .filter(p => p.querySelector('.chart'))
        .map(p => [p.dataset.key, +p.querySelector('.chart').dataset.points]))""")


def test_pages_draw_every_chart_from_real_data(run, dashboard, browser):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    expected = {
        "overview": {"throughput"},
        "learning": {"reward_by_version", "heldout_accuracy", "step_time", "tokens_per_s", "staleness", "kl_clip",
                     "trajectory_samples", "prefix_merges_breaks"},
        "llm": {"llm_calls_over_time", "llm_tokens_over_time", "llm_latency_over_time"},
    }
    for route, charts in expected.items():
        page = open_page(browser, dashboard, route)
        page.screenshot(path=str(SCREENSHOTS / f"{route}.png"), full_page=True)
        points = chart_points(page)
        assert set(points) == charts, points
        assert all(n > 0 for n in points.values()), (route, points)
        assert page.locator("canvas").count() >= len(charts)  # uPlot drew each one
        errors = page.locator(".panel .error").all_inner_texts()
        if route == "overview":
            lag = page.locator("#panel-consumer_lag").inner_text()
            assert page.locator("#panel-consumer_lag table").count() == 1, lag  # the stream and trainer groups
            assert page.get_attribute("#panel-dlq", "data-count") == "0"
        else:
            assert not errors, errors
        page.locator("details.sql summary").first.click()
        assert "FROM" in page.locator("details.sql pre").first.inner_text()
        page.close()


def test_rollout_view_shows_the_span_tree_reward_and_credit(run, dashboard, browser, clickhouse):
    _env, database = run
    page = open_page(browser, dashboard, "rollouts")
    total = clickhouse.query(f"SELECT count() FROM {database}.rollouts FINAL").result_rows[0][0]
    assert page.get_attribute("#rollout-count", "data-rows") == str(total) == "24"
    page.screenshot(path=str(SCREENSHOTS / "rollouts.png"), full_page=True)
    page.locator("section.panel tbody tr").first.click()
    page.wait_for_selector("body[data-loaded^='rollout/']", timeout=15_000)
    rollout_id = page.evaluate("document.body.dataset.loaded").split("/", 1)[1]
    spans, reward = clickhouse.query(
        f"SELECT (SELECT count() FROM {database}.spans FINAL WHERE rollout_id = {{r:String}}), "
        f"(SELECT final_reward FROM {database}.rollouts FINAL WHERE rollout_id = {{r:String}})",
        parameters={"r": rollout_id}).result_rows[0]
    assert spans >= 4  # the plan span, two LLM calls, the rewards
    assert page.get_attribute("#panel-rollout", "data-span-count") == str(spans)
    assert float(page.get_attribute("#panel-rollout", "data-reward")) == pytest.approx(reward)
    assert page.locator(".span[data-kind='LLM']").count() == 2
    assert page.locator(".span[data-kind='LLM'] .msg").count() >= 4  # each call's prompt and decoded response
    page.close()

    # a rollout that was trained on: each LLM call shows the credit it received and the transition it became
    trained, reward = clickhouse.query(
        f"SELECT rollout_id, final_reward FROM {database}.rollouts FINAL WHERE training = 'sampled' "
        f"AND rollout_id IN (SELECT rollout_id FROM {database}.transitions) ORDER BY rollout_id LIMIT 1").result_rows[0]
    page = open_page(browser, dashboard, f"rollout/{trained}")
    assert float(page.get_attribute("#panel-rollout", "data-reward")) == pytest.approx(reward)
    credits = page.locator(".span[data-kind='LLM'] > .credit").all_inner_texts()
    assert len(credits) == 2 and all("→ transition" in text for text in credits), credits
    assert page.locator("#panel-rollout_transitions tbody tr").count() == 2
    page.screenshot(path=str(SCREENSHOTS / "rollout.png"), full_page=True)
    page.close()


MERGES_BREAKS = {  # agent: (seconds before the newest rollout, prefix_merges, prefix_breaks) per rollout
    "calculator": [(120, 3, 0), (60, 2, 1), (0, 4, 0)],
    "planner": [(120, 0, 2), (0, 1, 1)],
}
TRAJECTORY_STEPS = [(1, 1.0, 0), (2, 2.5, 2), (3, 3.0, 1), (4, 2.0, 0)]  # step, calls_per_sample, prefix_breaks


@pytest.fixture
def trajectory_database(tmp_path, stack, clickhouse):
    """A database holding rollouts with merge and break counts and train steps with calls per sample, written
    directly (the stream processors and the trainer fill these columns in a real run)."""
    database = f"dash_traj_{uuid.uuid4().hex[:8]}"
    migrate(clickhouse, database)
    newest = datetime(2026, 11, 27, 6, 0, tzinfo=UTC)
    rows = [[f"{agent}-{number}", agent, "SUCCEEDED", newest - timedelta(seconds=ago),
             newest - timedelta(seconds=ago), merges, breaks]
            for agent, rollouts in MERGES_BREAKS.items() for number, (ago, merges, breaks) in enumerate(rollouts)]
    clickhouse.insert(f"{database}.rollouts", rows, column_names=[
        "rollout_id", "agent_name", "status", "start_time", "end_time", "prefix_merges", "prefix_breaks"])
    clickhouse.insert(f"{database}.train_steps", [["tiny", *step] for step in TRAJECTORY_STEPS],
                      column_names=["model", "step", "calls_per_sample", "prefix_breaks"])
    env = worker_env(tmp_path, stack, f"dashtraj{database[-8:]}.", database)
    process, url = start_dashboard(env)
    yield url
    process.terminate()
    process.wait(timeout=10)
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")


def test_the_learning_page_draws_merges_and_breaks_per_agent_and_calls_per_sample(trajectory_database, browser):
    page = open_page(browser, trajectory_database, "learning")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "trajectory.png"), full_page=True)
    drift = page.locator("#panel-prefix_merges_breaks .chart")
    assert drift.get_attribute("data-series") == "4"
    assert drift.get_attribute("data-points") == str(2 * sum(len(rows) for rows in MERGES_BREAKS.values()))
    legend = page.locator("#panel-prefix_merges_breaks .u-legend .u-label").all_inner_texts()
    assert set(legend[1:]) == {f"{agent} · {counted}" for agent in MERGES_BREAKS for counted in ("merges", "breaks")}
    samples = page.locator("#panel-trajectory_samples .chart")
    assert (samples.get_attribute("data-series"), samples.get_attribute("data-points")) == ("2", "8")

    rows = page.locator("#panel-prefix_by_agent tbody tr")
    shown = {cells[0]: cells[1:] for cells in (rows.nth(i).locator("td").all_inner_texts()
                                                for i in range(rows.count()))}
    assert shown == {"calculator": ["3", "9", "1", "0.1"], "planner": ["2", "1", "3", "0.75"]}

    with urllib.request.urlopen(trajectory_database + "api/page/learning", timeout=10) as response:
        panels = {panel["key"]: panel for panel in json.load(response)["panels"]}
    drawn: dict[str, float] = {}
    for _bucket, series, calls in panels["prefix_merges_breaks"]["rows"]:
        drawn[series] = drawn.get(series, 0) + calls
    assert drawn == {f"{agent} · {counted}": sum(row[column] for row in rollouts)
                     for agent, rollouts in MERGES_BREAKS.items()
                     for counted, column in (("merges", 1), ("breaks", 2))}
    steps = panels["trajectory_samples"]["rows"]
    assert [value for _step, series, value in steps if series.endswith("calls_per_sample")] == [
        calls for _step, calls, _breaks in TRAJECTORY_STEPS]
    assert [value for _step, series, value in steps if series.endswith("prefix_breaks")] == [
        breaks for _step, _calls, breaks in TRAJECTORY_STEPS]
    page.close()


def status_of(url: str, headers: dict[str, str] | None = None) -> tuple[int, str | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status, None
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("WWW-Authenticate")


def test_a_keyed_dashboard_lets_in_only_who_has_a_key(keyed_dashboard, browser):
    routes = ["", "api/health", "api/page/overview", "api/rollouts", "api/rollouts/none", "static/app.js"]
    for route in routes:
        assert status_of(keyed_dashboard + route) == (401, 'Basic realm="agentstream"'), route
        assert status_of(keyed_dashboard + route, {"Authorization": "Bearer wrong"})[0] == 401, route
        assert status_of(keyed_dashboard + route, {"Authorization": f"Bearer {DASHBOARD_KEY}"})[0] == 200, route
    typed = base64.b64encode(f"me:{DASHBOARD_KEY}".encode()).decode()
    assert status_of(keyed_dashboard, {"Authorization": f"Basic {typed}"})[0] == 200

    from playwright.sync_api import Error as BrowserError

    page = browser.new_page()
    with pytest.raises(BrowserError, match="ERR_INVALID_AUTH_CREDENTIALS"):  # asked for a key, the person gave none
        page.goto(keyed_dashboard)
    page.close()
    context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                  http_credentials={"username": "me", "password": DASHBOARD_KEY})
    page = context.new_page()  # the person typed the key into the browser's prompt
    page.goto(f"{keyed_dashboard}#overview")
    page.wait_for_selector("body[data-loaded='overview']", timeout=15_000)
    assert page.get_attribute("body", "data-error") is None
    assert chart_points(page)["throughput"] > 0
    context.close()


def test_a_dashboard_beyond_loopback_needs_keys(run):
    env, _database = run
    result = subprocess.run([sys.executable, "-m", "agentstream", "dashboard", "--host", "0.0.0.0", "--port",
                             str(free_port()), "--no-kafka"], env=env, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: refusing to serve the dashboard on 0.0.0.0 without keys: anyone who reaches 0.0.0.0 could call it. "
        "Set [security] dashboard_keys, listen on 127.0.0.1, or set [security] allow_open_bind = true"]


def test_every_query_runs_read_only_on_an_empty_database(clickhouse, stack, stack_config):
    database = f"dash_empty_{uuid.uuid4().hex[:8]}"
    migrate(clickhouse, database)
    parameters = {"window_s": 600, "bucket_s": 10, "limit": 20, "agent": "", "status": "", "version": -1,
                  "min_reward": -1e308, "since_s": 0, "rollout_id": "none"}
    charts = [*(c for page in queries.PAGES.values() for c in page), *queries.ROLLOUT_DETAIL,
              queries.rollout_list(), queries.rollout_filters()]

    async def check() -> None:
        warehouse = await Warehouse(stack_config.clickhouse, stack.clickhouse_url, database).start()
        try:
            for chart in charts:
                await warehouse.query(chart.sql, {name: parameters[name] for name in chart.parameters})
            with pytest.raises(WarehouseError, match=r"(?i)readonly"):
                await warehouse.query(f"INSERT INTO {database}.checkpoints (model) VALUES ('x')")
        finally:
            await warehouse.close()

    try:  # in a thread of its own: Playwright's sync API keeps an event loop running in this one
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, check()).result()
    finally:
        clickhouse.command(f"DROP DATABASE IF EXISTS {database}")
