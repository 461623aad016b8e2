// agentstream dashboard: renders the JSON the server's /api routes return. Charts are uPlot (vendored, MIT).
"use strict";

const PALETTE = ["#2f6fde", "#e0592a", "#1c9c5b", "#9b51e0", "#d4a017", "#0aa3b5", "#c2185b", "#5d6b82",
  "#7cb342", "#8d6e63"];
const REFRESH_MS = 5000;
const main = document.getElementById("main");
const statusEl = document.getElementById("status");
const windowEl = document.getElementById("window");
const liveEl = document.getElementById("live");
let plots = [];
let timer = null;
let rendering = false;
const openQueries = new Set();

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, {cache: "no-store"});
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status} ${await response.text()}`);
  return response.json();
}

function fmt(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") {
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    return Math.abs(value) >= 1000 ? value.toFixed(0) : value.toPrecision(4).replace(/\.?0+$/, "");
  }
  if (Array.isArray(value)) return value.map(fmt).join(", ");
  if (typeof value === "object") return JSON.stringify(value);
  return String(value).replace(/^(\d{4}-\d\d-\d\d)T(\d\d:\d\d:\d\d)(\.\d+)?Z?$/, "$1 $2");
}

function sqlToggle(panel) {
  const params = panel.parameter_values && Object.keys(panel.parameter_values).length
    ? "-- parameters: " + Object.entries(panel.parameter_values).map(([k, v]) => `${k} = ${JSON.stringify(v)}`).join(", ") + "\n"
    : "";
  const details = el("details", {class: "sql"}, el("summary", {}, `show query (${panel.elapsed_ms} ms)`),
    el("pre", {}, params + panel.sql));
  details.open = openQueries.has(panel.key);  // a live refresh keeps an opened query open
  details.addEventListener("toggle", () => {
    if (details.open) openQueries.add(panel.key); else openQueries.delete(panel.key);
  });
  return details;
}

function panelCard(panel, wide) {
  const card = el("section", {class: "panel" + (wide ? " wide" : ""), id: "panel-" + panel.key,
    "data-key": panel.key});
  card.append(el("h2", {}, panel.title));
  if (panel.note) card.append(el("div", {class: "note"}, panel.note));
  return card;
}

function table(columns, rows, onRow) {
  const head = el("tr", {}, ...columns.map(c => el("th", {}, c)));
  const body = rows.map(row => {
    const tr = el("tr", onRow ? {class: "link", onclick: () => onRow(row)} : {},
      ...row.map(v => el("td", typeof v === "number" ? {class: "num"} : {}, fmt(v))));
    return tr;
  });
  return el("div", {class: "tablewrap"}, el("table", {}, el("thead", {}, head), el("tbody", {}, ...body)));
}

// Rows to uPlot's aligned columns: long form (x, series, y) pivots on series; wide form has a line per column.
function toSeries(panel) {
  const xi = panel.columns.indexOf(panel.x);
  const xs = [...new Set(panel.rows.map(r => r[xi]).filter(v => v !== null))].sort((a, b) => a - b);
  const position = new Map(xs.map((x, i) => [x, i]));
  const names = [];
  const columns = [];
  if (panel.series) {
    const si = panel.columns.indexOf(panel.series), yi = panel.columns.indexOf(panel.y);
    const byName = new Map();
    for (const row of panel.rows) {
      if (row[xi] === null) continue;
      if (!byName.has(row[si])) { byName.set(row[si], new Array(xs.length).fill(null)); names.push(row[si]); }
      byName.get(row[si])[position.get(row[xi])] = row[yi];
    }
    for (const name of names) columns.push(byName.get(name));
  } else {
    panel.columns.forEach((name, index) => {
      if (index === xi) return;
      names.push(name);
      const column = new Array(xs.length).fill(null);
      for (const row of panel.rows) if (row[xi] !== null) column[position.get(row[xi])] = row[index];
      columns.push(column);
    });
  }
  return {xs, names, columns};
}

function lineChart(card, panel) {
  const {xs, names, columns} = toSeries(panel);
  const points = columns.reduce((n, c) => n + c.filter(v => v !== null && v !== undefined).length, 0);
  const holder = el("div", {class: "chart", "data-series": names.length, "data-points": points});
  card.append(holder);
  if (!points) { holder.append(el("div", {class: "empty"}, "no data in this window yet")); return; }
  const width = Math.max(300, card.clientWidth - 28);
  const xScale = {time: panel.x_time};
  if (xs.length === 1) {  // one x value: uPlot's automatic range would span years (time) or 0..100
    const pad = panel.x_time ? ((panel.parameter_values || {}).bucket_s || 60) * 5 : 1;
    xScale.range = () => [xs[0] - pad, xs[0] + pad];
  }
  const opts = {
    width, height: 240,
    scales: {x: xScale},
    axes: [panel.x_time ? {} : {incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000]},
      {label: panel.unit || "", size: 60}],
    series: [{label: panel.x}, ...names.map((name, i) => ({
      label: String(name), stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: !panel.x_time,
      points: {show: xs.length < 40}, value: (u, v) => fmt(v),
    }))],
    legend: {live: true},
  };
  plots.push(new uPlot(opts, [xs, ...columns], holder));
}

function renderPanel(panel, wide) {
  const card = panelCard(panel, wide);
  if (panel.error) card.append(el("div", {class: "error"}, panel.error));
  else if (panel.shape === "lines") lineChart(card, panel);
  else if (!panel.rows.length) card.append(el("div", {class: "empty", "data-rows": 0}, "no rows yet"));
  else card.append(table(panel.columns, panel.rows));
  card.append(sqlToggle(panel));
  return card;
}

function kafkaCards(kafka) {
  const lag = el("section", {class: "panel", id: "panel-consumer_lag", "data-key": "consumer_lag"},
    el("h2", {}, "Consumer lag per group"),
    el("div", {class: "note"}, "committed offset vs. the partition's log end (Kafka admin API, not SQL)"));
  if (kafka.error) lag.append(el("div", {class: "error"}, kafka.error));
  lag.append(kafka.lag.length ? table(kafka.lag_columns, kafka.lag) : el("div", {class: "empty"}, "no consumer groups"));
  const dlq = el("section", {class: "panel", id: "panel-dlq", "data-key": "dlq", "data-count": kafka.dlq_count},
    el("h2", {}, "Dead letters"),
    el("div", {class: "note"}, `records the stream processors could not read, on ${kafka.dlq_topic || "the dlq topic"}`),
    el("div", {class: "big"}, fmt(kafka.dlq_count)));
  if (kafka.dead_letters.length) {
    const rows = kafka.dead_letters.map(r => [new Date(r[0] * 1000).toISOString(), ...r.slice(1)]);
    dlq.append(el("div", {class: "note"}, "latest reasons"), table(kafka.dead_letter_columns, rows));
  }
  return [lag, dlq];
}

function clear() {
  for (const plot of plots) plot.destroy();
  plots = [];
  main.replaceChildren();
}

async function showPage(name) {
  const data = await getJSON(`/api/page/${name}?window_s=${windowEl.value}`);
  clear();
  const cards = data.panels.map(p => renderPanel(p, p.shape === "table" && p.key !== "serving"));
  if (name === "overview") {
    main.append(cards[0], ...kafkaCards(data.kafka), ...cards.slice(1));
  } else main.append(...cards);
  // draw the charts after the cards are in the page, so they know their width
  for (const plot of plots) plot.setSize({width: Math.max(300, plot.root.parentElement.parentElement.clientWidth - 28), height: 240});
  return data.elapsed_ms;
}

const filterState = {agent: "", status: "", version: "", min_reward: "", since_s: ""};

async function showRollouts() {
  const query = new URLSearchParams(Object.entries(filterState).filter(([, v]) => v !== "")).toString();
  const data = await getJSON(`/api/rollouts?${query}`);
  const [listing, facets] = data.panels;
  const values = facet => facets.rows.filter(r => r[0] === facet).map(r => r[1]);
  const select = (name, options) => el("label", {}, name, el("select", {
    onchange: e => { filterState[name] = e.target.value; refresh(); }},
    el("option", {value: ""}, "any"),
    ...options.map(o => { const opt = el("option", {value: o}, o); if (String(filterState[name]) === String(o)) opt.selected = true; return opt; })));
  const input = (name, placeholder) => el("label", {}, name, el("input", {value: filterState[name], placeholder,
    onchange: e => { filterState[name] = e.target.value; refresh(); }}));
  const card = panelCard(listing, true);
  card.append(el("div", {class: "filters"}, select("agent", values("agent")), select("status", values("status")),
    select("version", values("version")), input("min_reward", "e.g. 0.5"),
    el("label", {}, "time", el("select", {onchange: e => { filterState.since_s = e.target.value; refresh(); }},
      ...[["", "all"], ["300", "last 5 min"], ["3600", "last hour"], ["86400", "last day"]].map(([v, t]) => {
        const o = el("option", {value: v}, t); if (filterState.since_s === v) o.selected = true; return o; })))));
  if (listing.error) card.append(el("div", {class: "error"}, listing.error));
  card.append(el("div", {class: "note", id: "rollout-count", "data-rows": listing.rows.length},
    `${listing.rows.length} rollouts (newest first, at most 200)`));
  card.append(table(listing.columns, listing.rows, row => { location.hash = "#rollout/" + encodeURIComponent(row[0]); }));
  card.append(sqlToggle(listing));
  clear();
  main.append(card);
  return data.elapsed_ms;
}

function parseJSON(text) {
  if (!text) return null;
  try { return JSON.parse(text); } catch (e) { return text; }
}

function messageText(message) {
  if (typeof message === "string") return message;
  const content = message.content;
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map(p => p.text || p.content || JSON.stringify(p)).join("\n");
  if (Array.isArray(message.parts)) return message.parts.map(p => p.content || p.text || JSON.stringify(p)).join("\n");
  if (message.tool_calls) return JSON.stringify(message.tool_calls);
  return content === null || content === undefined ? "" : JSON.stringify(content);
}

function messages(label, text) {
  const parsed = parseJSON(text);
  if (parsed === null) return null;
  const list = Array.isArray(parsed) ? parsed : [parsed];
  return el("div", {}, el("div", {class: "note"}, label),
    ...list.map(m => el("div", {class: "msg"}, el("b", {}, (m.role || "") + " "), messageText(m))));
}

function spanNode(span, children, credit) {
  const head = el("div", {class: "head"}, el("span", {class: "kind " + span.kind}, span.kind), el("b", {}, span.name),
    el("span", {class: "muted"}, `${fmt(span.duration_ms)} ms · ${span.status}`),
    span.model ? el("span", {class: "muted"}, `${span.model} v${fmt(span.policy_version)}`) : null,
    span.kind === "LLM" ? el("span", {class: "muted"},
      `tokens ${span.prompt_tokens || span.usage_input_tokens || 0} in / ${span.completion_tokens || span.usage_output_tokens || 0} out`) : null,
    span.reward !== null ? el("span", {class: "credit"}, `reward ${fmt(span.reward)}`) : null);
  const node = el("div", {class: "span", "data-span-id": span.span_id, "data-kind": span.kind}, head);
  if (span.status_message) node.append(el("div", {class: "error"}, span.status_message));
  if (span.kind === "LLM") {
    node.append(messages("messages", span.input_messages) || "", messages("response (decoded)", span.output_messages) || "");
    node.append(el("div", {class: credit ? "credit" : "muted"}, credit
      ? `credit: reward ${fmt(credit.reward)} · return ${fmt(credit.return_value)} · advantage ${fmt(credit.advantage)} → transition ${credit.transition_id} (step ${credit.step_index}, policy v${credit.policy_version})`
      : "no transition (not trained on, or not credited yet)"));
  }
  if (children.length) node.append(el("div", {class: "children"}, ...children));
  return node;
}

function records(panel) {
  return panel.rows.map(row => Object.fromEntries(panel.columns.map((c, i) => [c, row[i]])));
}

async function showRollout(rolloutId) {
  const data = await getJSON(`/api/rollouts/${encodeURIComponent(rolloutId)}`);
  const [summaryPanel, spansPanel, transitionsPanel] = data.panels;
  const summary = records(summaryPanel)[0];
  const spans = records(spansPanel);
  const transitions = records(transitionsPanel);
  const creditBySpan = new Map(transitions.map(t => [t.span_id, t]));
  clear();
  const head = panelCard({key: "rollout", title: `Rollout ${rolloutId}`}, true);
  head.setAttribute("data-span-count", spans.length);
  head.setAttribute("data-reward", summary && summary.final_reward !== null ? summary.final_reward : "");
  if (!summary) head.append(el("div", {class: "error"}, summaryPanel.error || "no such rollout"));
  else head.append(el("div", {class: "kv"}, ...Object.entries(summary).flatMap(([k, v]) => [el("div", {}, k),
    el("div", {}, fmt(v))])));
  head.append(sqlToggle(summaryPanel));
  const ids = new Set(spans.map(s => s.span_id));
  // Spans without a parent in the rollout (the proxy's LLM calls carry none unless the agent sent a
  // traceparent) hang under the rollout's root AGENT span when there is exactly one.
  const agentRoots = spans.filter(s => s.kind === "AGENT" && !ids.has(s.parent_id));
  const top = agentRoots.length === 1 ? agentRoots[0].span_id : "";
  const childrenOf = new Map();
  for (const span of spans) {
    const parent = ids.has(span.parent_id) ? span.parent_id : (span.span_id === top ? "" : top);
    if (!childrenOf.has(parent)) childrenOf.set(parent, []);
    childrenOf.get(parent).push(span);
  }
  const build = span => spanNode(span, (childrenOf.get(span.span_id) || []).map(build), creditBySpan.get(span.span_id));
  const tree = panelCard({key: "span_tree", title: `Span tree (${spans.length} spans)`}, true);
  tree.append(el("div", {class: "tree"}, ...(childrenOf.get("") || []).map(build)), sqlToggle(spansPanel));
  const credit = renderPanel({...transitionsPanel, title: "Transitions this rollout became (credit per LLM call)"}, true);
  main.append(head, tree, credit);
  return data.elapsed_ms;
}

async function refresh() {
  if (rendering) return;
  rendering = true;
  const hash = decodeURIComponent(location.hash.replace(/^#/, "")) || "overview";
  const page = hash.startsWith("rollout/") ? "rollouts" : hash;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  const started = performance.now();
  try {
    let serverMs;
    if (hash.startsWith("rollout/")) serverMs = await showRollout(hash.slice("rollout/".length));
    else if (hash === "rollouts") serverMs = await showRollouts();
    else serverMs = await showPage(["overview", "learning", "llm"].includes(hash) ? hash : "overview");
    const total = performance.now() - started;
    statusEl.textContent = `updated ${new Date().toLocaleTimeString()} · ${Math.round(total)} ms (server ${Math.round(serverMs)} ms)`;
    document.body.dataset.loaded = hash;
    document.body.dataset.loadMs = Math.round(total);
  } catch (error) {
    statusEl.textContent = "error: " + error.message;
    document.body.dataset.error = error.message;
  } finally {
    rendering = false;
  }
}

function schedule() {
  clearInterval(timer);
  // the rollout view does not refresh by itself: a user reading a trajectory keeps their place
  // nor does a page while the user is in one of its inputs (a filter being typed or chosen)
  const busy = () => location.hash.startsWith("#rollout/") ||
    (main.contains(document.activeElement) && /^(INPUT|SELECT)$/.test(document.activeElement.tagName));
  if (liveEl.checked) timer = setInterval(() => { if (!busy()) refresh(); }, REFRESH_MS);
}

window.addEventListener("hashchange", () => { delete document.body.dataset.loaded; refresh(); });
windowEl.addEventListener("change", refresh);
liveEl.addEventListener("change", schedule);
window.addEventListener("resize", () => refresh());
refresh();
schedule();
