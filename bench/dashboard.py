"""Dashboard load time with 1 million spans in ClickHouse: each page's API and the page in headless Chromium.

Fills a private stack's ClickHouse with INSERT ... SELECT FROM numbers(): 1,000,000 spans over the
last hour (125,000 rollouts of 8 spans, 4 of them LLM calls with 100 prompt and 100 response token
ids and chat messages), their rollouts, 500,000 transitions, 600 trainer steps and 60 deployment
decisions. Then serves the dashboard and prints, as JSON lines, each API route's cold and median
time (the default 15-minute window, and a day's, which holds every span), and, when Chromium is installed, each
page's time from navigation to drawn (target: < 1 s).

Run: ``python -m bench.dashboard [--spans N] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import urllib.request

from agentstream.dashboard.server import DashboardThread
from agentstream.infra.clickhouse import connect, migrate
from bench.common import emit, private_stack

BENCH = "dashboard"
DATABASE = "dashboard_bench"
SPANS_PER_ROLLOUT = 8


def fill(client, spans: int) -> dict[str, int]:
    """The tables as a busy hour of training leaves them; returns row counts (generated inside ClickHouse)."""
    rollouts = spans // SPANS_PER_ROLLOUT
    span_sql = f"""
INSERT INTO {DATABASE}.spans (span_id, rollout_id, attempt_id, parent_id, name, kind, start_time, end_time, status,
    agent_name, task_id, group_id, model, policy_version, attributes, prompt_token_ids, response_token_ids,
    response_logprobs, reward)
SELECT concat('s', toString(number)) AS span_id, concat('r', toString(intDiv(number, {SPANS_PER_ROLLOUT}))) AS rid,
    concat(rid, '-1'), if(number % {SPANS_PER_ROLLOUT} = 0, '', concat('s', toString(number - number % 8))),
    multiIf(number % 8 = 0, 'agent', number % 8 IN (1, 3, 5, 7), 'chat smollm2', number % 8 = 6, 'reward', 'tool'),
    multiIf(number % 8 = 0, 'AGENT', number % 8 IN (1, 3, 5, 7), 'LLM', number % 8 = 6, 'REWARD', 'TOOL') AS kind,
    now64(6) - toIntervalMicrosecond((n - number) * 3600) AS start,
    start + toIntervalMicrosecond(if(kind = 'LLM', 20000 + cityHash64(number) % 400000, 1000)),
    if(cityHash64(number, 1) % 200 = 0, 'ERROR', 'OK'),
    ['arithmetic', 'support', 'arithmetic-eval'][1 + intDiv(number, 8) % 3],
    concat('t', toString(intDiv(number, 32) % 5000)),
    concat('g', toString(intDiv(number, 32))), 'smollm2', toInt64(intDiv(number * 40, n)),
    if(kind = 'LLM', map('gen_ai.input.messages',
                        '[{{"role":"user","content":"Compute 12+7. Answer with the number."}}]',
                        'gen_ai.output.messages', '[{{"role":"assistant","content":"The answer is 19."}}]',
                        'gen_ai.request.model', 'smollm2'), map()),
    if(kind = 'LLM', arrayMap(x -> toUInt32(cityHash64(number, x) % 49152), range(100)), []),
    if(kind = 'LLM', arrayMap(x -> toUInt32(cityHash64(x, number) % 49152), range(100)), []),
    if(kind = 'LLM', arrayMap(x -> toFloat32(-(cityHash64(x, number, 2) % 1000) / 500), range(100)), []),
    if(kind = 'REWARD', (cityHash64(number, 3) % 100) / 100, NULL)
FROM (SELECT number, {spans} AS n FROM numbers({spans}))"""
    client.command(span_sql)
    client.command(f"""
INSERT INTO {DATABASE}.rollouts (rollout_id, attempt_id, task_id, group_id, agent_name, model, status, start_time,
    end_time, span_count, llm_calls, final_reward, total_reward, policy_versions, updated_at, training)
SELECT concat('r', toString(number)) AS rid, concat(rid, '-1'), concat('t', toString(intDiv(number, 4) % 5000)),
    concat('g', toString(intDiv(number, 4))), ['arithmetic', 'support', 'arithmetic-eval'][1 + number % 3] AS agent,
    'smollm2', if(cityHash64(number) % 50 = 0, 'FAILED', 'SUCCEEDED') AS status,
    now64(6) - toIntervalMicrosecond(({rollouts} - number) * 28800) AS start, start + toIntervalMillisecond(900),
    8, 4, if(status = 'FAILED', NULL, least(1.0, number / {rollouts} * 0.6 + (cityHash64(number, 2) % 40) / 100)),
    0, [toInt64(intDiv(number * 40, {rollouts}))], start + toIntervalSecond(1),
    if(status = 'FAILED', '', if(agent = 'arithmetic-eval', 'not_trained', 'sampled'))
FROM numbers({rollouts})""")
    client.command(f"""
INSERT INTO {DATABASE}.transitions (transition_id, rollout_id, span_id, agent_name, model, policy_version, step_index,
    group_id, prompt_token_ids, response_token_ids, behaviour_logprobs, reward, return_value, advantage, created_at)
SELECT concat('x', toString(number)), concat('r', toString(intDiv(number, 4))),
    concat('s', toString(intDiv(number, 4) * 8 + 1 + (number % 4) * 2)), 'arithmetic', 'smollm2',
    toInt64(intDiv(number * 40, {rollouts * 4})), toUInt32(number % 4), concat('g', toString(intDiv(number, 16))),
    arrayMap(x -> toUInt32(x), range(100)), arrayMap(x -> toUInt32(x), range(100)),
    arrayMap(x -> toFloat32(-0.5), range(100)),
    0.5, 0.5, (cityHash64(number) % 200) / 100 - 1,
    now64(6) - toIntervalMicrosecond(({rollouts * 4} - number) * 7200)
FROM numbers({rollouts * 4})""")
    client.command(f"""
INSERT INTO {DATABASE}.train_steps (model, step, policy_version, loss, reward_mean, kl, clip_fraction, staleness_mean,
    staleness_max, dropped_stale, transitions, tokens, tokens_per_s, step_time_s, created_at)
SELECT 'smollm2', number + 1, intDiv(number, 15), 0.1, 0.5, 0.001 * (number % 7), 0.02 * (number % 5), 0.7, 2,
    number % 3, 96, 19200, 1500 + number % 300, 6 + (number % 10) / 10, now64(6) - toIntervalSecond((600 - number) * 6)
FROM numbers(600)""")
    client.command(f"""
INSERT INTO {DATABASE}.deployments (decision_id, model, version, action, decided_by, reason, stable_version,
    canary_version, canary_share, candidate_score, stable_score, eval_tasks, decided_at)
SELECT concat('d', toString(number)), 'smollm2', intDiv(number, 3) + 1 AS v,
    ['CANDIDATE', 'CANARY', 'PROMOTED'][1 + number % 3], 'gate', 'bench', if(number % 3 = 2, v, v - 1),
    if(number % 3 = 1, v, NULL), if(number % 3 = 1, 0.1, 0), 0.5 + v / 100, 0.5 + (v - 1) / 100, 64,
    now64(6) - toIntervalSecond((60 - number) * 60)
FROM numbers(60)""")
    counts = {}
    for table in ("spans", "rollouts", "transitions", "train_steps", "deployments"):
        counts[table] = int(client.query(f"SELECT count() FROM {DATABASE}.{table}").result_rows[0][0])
    return counts


def timed_get(url: str) -> tuple[float, dict]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = json.load(response)
    return (time.perf_counter() - started) * 1000, body


def browser_times(url: str, routes: list[str], repeat: int) -> dict[str, list[float]]:
    """Milliseconds from navigation to the page drawn, per route, in headless Chromium (empty without one)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return {}
    from playwright.sync_api import sync_playwright

    times: dict[str, list[float]] = {route: [] for route in routes}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for route in routes:
            for _ in range(repeat):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                started = time.perf_counter()
                page.goto(f"{url}#{route}")
                page.wait_for_selector(f"body[data-loaded='{route}']", timeout=30_000)
                times[route].append((time.perf_counter() - started) * 1000)
                page.close()
        browser.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with private_stack(AGENTSTREAM_BROKER_STORAGE="memory") as (config, endpoints):
        client = connect(config.clickhouse, endpoints.clickhouse_url)
        migrate(client, DATABASE)
        started = time.perf_counter()
        counts = fill(client, args.spans)
        emit(BENCH, "fill_s", time.perf_counter() - started, "s", **counts)
        rollout_id = f"r{counts['rollouts'] // 2}"
        client.close()
        dashboard = DashboardThread(config, endpoints.clickhouse_url, endpoints.bootstrap_servers, database=DATABASE)
        try:
            url = dashboard.url + "/"
            routes = {"overview": "api/page/overview", "learning": "api/page/learning", "llm": "api/page/llm",
                      "rollouts": "api/rollouts", f"rollout/{rollout_id}": f"api/rollouts/{rollout_id}"}
            for route, path in routes.items():
                cold, body = timed_get(url + path)
                assert all(not panel["error"] for panel in body["panels"]), body
                warm = [timed_get(url + path)[0] for _ in range(args.repeat)]
                slowest = max(body["panels"], key=lambda panel: panel["elapsed_ms"])
                emit(BENCH, f"api_{route.split('/')[0]}_ms", statistics.median(warm), "ms", cold_ms=round(cold, 1),
                     spans=counts["spans"], slowest_panel=slowest["key"], slowest_panel_ms=slowest["elapsed_ms"])
            for page in ("overview", "learning", "llm"):  # a day's window: every span in the series
                warm = [timed_get(f"{url}api/page/{page}?window_s=86400")[0] for _ in range(args.repeat)]
                emit(BENCH, f"api_{page}_day_window_ms", statistics.median(warm), "ms", spans=counts["spans"])
            for route, times in browser_times(url, list(routes), args.repeat).items():
                emit(BENCH, f"page_{route.split('/')[0]}_ms", statistics.median(times), "ms",
                     max_ms=round(max(times), 1), spans=counts["spans"], target_ms=1000,
                     under_target=max(times) < 1000)
        finally:
            dashboard.stop()


if __name__ == "__main__":
    main()
