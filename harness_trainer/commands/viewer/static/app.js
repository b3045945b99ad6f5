"use strict";
// The run viewer. Every piece of data arrives as a small script calling HV.receive(path, data): the server
// answers data/PATH.js from the run folder, and an exported page has the same files on disk (serve.py says why).
// Nothing is loaded before it is shown: the rollout table's rows first, a rollout when it is opened, a turn's
// tokens when its turn scrolls into view, earlier context only when asked for.

const HV = {
  waiting: new Map(),
  receive(path, data) { this.settle(path, (w) => w.resolve(data)); },
  fail(path, message) { this.settle(path, (w) => w.reject(new Error(message))); },
  settle(path, how) { const w = this.waiting.get(path); if (w) { this.waiting.delete(path); how(w); } },
};
const cache = new Map();

function get(path) {
  if (!cache.has(path)) {
    cache.set(path, new Promise((resolve, reject) => {
      HV.waiting.set(path, { resolve, reject });
      const s = document.createElement("script");
      s.src = `data/${path}.js` + (location.protocol.startsWith("http") ? `?t=${Date.now()}` : "");
      s.onload = () => { s.remove(); HV.fail(path, `data/${path}.js held no data`); };
      s.onerror = () => { s.remove(); HV.fail(path, `could not load data/${path}.js`); };
      document.head.appendChild(s);
    }));
  }
  return cache.get(path);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) if (child != null) node.append(child);
  return node;
}
const $ = (id) => document.getElementById(id);
const fmt = (v) => (v == null ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(3)) : String(v));
function facts(pairs) {
  return el("table", { class: "facts" }, pairs.filter(([, v]) => v !== undefined && v !== "")
    .map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v)))));
}
function showError(err) { $("error").hidden = false; $("error").textContent = String(err.message || err); }

// ---------------------------------------------------------------- the run: overview and curves
const PANELS = [
  ["Reward", (k) => ["reward_mean", "reward_max", "verifier_reward_mean"].includes(k) || k.startsWith("rewards/")],
  ["Groups", (k) => ["zero_variance_groups", "dropped_stale", "dropped_stale_rollouts", "cancelled", "cancelled_in_flight", "failed"].includes(k)],
  ["Where the time goes (s)", (k) => ["step_time_s", "wait_for_groups_s", "train_time_s", "weight_sync_time_s", "generation_s"].includes(k)],
  ["Idle and overlap", (k) => k.endsWith("idle_ratio") || ["ideal_speedup", "calls_in_flight_mean"].includes(k)],
  ["Sampled tokens, trained and discarded", (k) => k === "sampled_tokens" || k.startsWith("discarded_tokens/")],
  ["Staleness", (k) => k === "staleness"],
  ["Tokens", (k) => ["trained_tokens", "completion_tokens_mean", "tree_tokens", "row_tokens"].includes(k) || k.includes("micro")],
  ["Stability", (k) => ["loss", "grad_norm", "probe_gap", "behaviour_kl_k3", "behaviour_kl"].includes(k) || /^(entropy|step_)/.test(k)],
  ["Policy ratios and clipping", (k) => /^(behaviour_|clip_|ratio_|is_)/.test(k)],
];
const NOT_CURVES = new Set(["step", "version", "groups", "rollouts", "scorable", "lr"]);

function drawCharts(metrics) {
  const box = $("charts");
  box.replaceChildren();
  if (!metrics.length) { box.append(el("p", { class: "note" }, "no training steps in this folder (an eval or traces only)")); return; }
  const keys = [...new Set(metrics.flatMap((m) => Object.keys(m)))]
    .filter((k) => !NOT_CURVES.has(k) && metrics.some((m) => typeof m[k] === "number" || typeof m[k] === "boolean"));
  const used = new Set();
  const panels = PANELS.map(([title, test]) => [title, keys.filter((k) => test(k) && !used.has(k) && used.add(k))]);
  panels.push(["Other", keys.filter((k) => !used.has(k))]);
  const steps = metrics.map((m) => m.step);
  for (const [title, names] of panels) {
    if (!names.length) continue;
    const div = el("div", { class: "chart" });
    box.append(div);
    const traces = names.map((k) => ({ x: steps, y: metrics.map((m) => (typeof m[k] === "boolean" ? +m[k] : m[k] ?? null)),
      name: k, mode: "lines+markers", type: "scatter" }));
    Plotly.newPlot(div, traces, { title: { text: `${title}, per step`, font: { size: 14 } }, height: 250 + 18 * Math.ceil(names.length / 3),
      margin: { l: 50, r: 10, t: 36, b: 10 }, xaxis: { dtick: steps.length <= 20 ? 1 : undefined, automargin: true },
      legend: { orientation: "h", y: -0.12, yanchor: "top", font: { size: 11 } } }, { displayModeBar: false, responsive: true });
  }
}

let stepsTable = null;
function drawSteps(metrics) {
  const table = $("steps");
  if (stepsTable) { stepsTable.destroy(); stepsTable = null; }
  table.replaceChildren();
  if (!metrics.length) { $("steps-box").hidden = true; return; }
  $("steps-box").hidden = false;
  const keys = [...new Set(metrics.flatMap((m) => Object.keys(m)))];
  stepsTable = new DataTable(table, { data: metrics, paging: false, scrollX: true, order: [[keys.indexOf("step"), "asc"]],
    columns: keys.map((k) => ({ title: k, data: (row) => row[k] ?? null, render: (v) => (Array.isArray(v) ? v.join("; ") : fmt(v)) })) });
}

// ---------------------------------------------------------------- the rollout table
const COLUMNS = [
  ["#", "i"], ["task", "task"], ["status", "status"], ["why", "reason"], ["reward", "reward"], ["turns", "turns"],
  ["sampled tokens", "sampled_tokens"], ["trained tokens", "trained_tokens"], ["context tokens", "context_tokens"],
  ["tool calls", "tool_calls"], ["invalid calls", "invalid_tool_calls"], ["tool failures", "tool_failures"],
  ["policy versions", "policy_versions"], ["seconds", "seconds"],
];
const FILTERS = ["status", "task", "reward"];
let table = null;

function drawRollouts(rows) {
  const node = $("rollout-table");
  if (table) { table.destroy(); node.replaceChildren(); }
  $("rollout-count").textContent = `${rows.length} in this run`;
  table = new DataTable(node, {
    data: rows, deferRender: true, pageLength: 25, order: [[0, "asc"]],
    columns: COLUMNS.map(([title, key]) => ({ title, data: key, defaultContent: "",
      render: (v, type) => (type === "display" || type === "filter" ? (v == null ? "none" : fmt(v)) : v ?? -Infinity) })),
    createdRow: (tr, row) => { tr.dataset.rollout = row.i; },
  });
  node.querySelector("tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr[data-rollout]");
    if (tr) location.hash = `${state.run}/${tr.dataset.rollout}`;
  });
  const box = $("filters");
  box.replaceChildren();
  for (const key of FILTERS) {
    const column = COLUMNS.findIndex(([, k]) => k === key);
    const values = [...new Set(rows.map((r) => (r[key] == null ? "none" : fmt(r[key]))))].sort();
    const select = el("select", { id: `filter-${key}` }, el("option", { value: "" }, "all"), values.map((v) => el("option", { value: v }, v)));
    select.addEventListener("change", () => {
      const v = select.value;
      table.column(column).search(v ? `^${DataTable.util.escapeRegex(v)}$` : "", true, false).draw();
    });
    box.append(el("label", {}, `${key} `, select));
  }
}

// ---------------------------------------------------------------- one rollout
function drawGraph(calls) {
  const div = $("graph");
  if (!calls.length) { div.replaceChildren(el("p", { class: "note" }, "no captured calls")); return; }
  const byId = new Map(calls.map((c) => [c.node_id, c]));
  const lane = new Map(), continued = new Set();
  let lanes = 0;
  for (const c of [...calls].sort((a, b) => a.index - b.index)) {  // a fork or a new root opens a lane
    const p = c.parent && byId.get(c.parent);
    if (p && lane.has(p.node_id) && !continued.has(p.node_id)) { lane.set(c.node_id, lane.get(p.node_id)); continued.add(p.node_id); }
    else lane.set(c.node_id, lanes++);
  }
  const edges = { x: [], y: [], mode: "lines", line: { color: "#aaa" }, hoverinfo: "skip", showlegend: false, type: "scatter" };
  for (const c of calls) {
    const p = c.parent && byId.get(c.parent);
    if (p) edges.x.push(p.index, c.index, null), edges.y.push(-lane.get(p.node_id), -lane.get(c.node_id), null);
  }
  const colours = { agent: "#2a7", auxiliary: "#999", discarded: "#d55" };
  const roles = [...new Set(calls.map((c) => c.role || "agent"))];
  const nodes = roles.map((role) => {
    const mine = calls.filter((c) => (c.role || "agent") === role);
    return { type: "scatter", mode: "markers", name: role, x: mine.map((c) => c.index), y: mine.map((c) => -lane.get(c.node_id)),
      customdata: mine.map((c) => c.turn), marker: { size: 14, color: colours[role] || "#57a" },
      text: mine.map((c) => `call ${c.index} (${role})<br>${c.prompt_tokens} prompt + ${c.completion_tokens} sampled tokens` +
        `<br>policy version ${fmt(c.policy_version)} (${fmt(c.model)}) · finish ${fmt(c.finish_reason)}` + (c.problem ? `<br>${c.problem}` : "")),
      hoverinfo: "text" };
  });
  Plotly.newPlot(div, [edges, ...nodes], { height: 110 + 34 * lanes, margin: { l: 20, r: 10, t: 10, b: 40 },
    xaxis: { title: { text: "call, in arrival order" }, dtick: 1, zeroline: false }, yaxis: { visible: false },
    legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" } }, { displayModeBar: false, responsive: true });
  div.on("plotly_click", (ev) => {
    const turn = ev.points[0].customdata;
    if (turn != null) $(`turn-${turn}`).scrollIntoView({ behavior: "smooth" });
  });
}

function drawMessages(messages) {
  const text = (content) => (typeof content === "string" ? content : Array.isArray(content)
    ? content.map((p) => p.text ?? p.content ?? JSON.stringify(p)).join("\n") : content == null ? "" : JSON.stringify(content, null, 1));
  $("conversation").replaceChildren(...messages.map((m) => el("div", { class: `message ${m.role}` },
    el("div", { class: "role" }, m.role + (m.name ? ` (${m.name})` : "")),
    el("pre", {}, text(m.content)),
    (m.tool_calls || []).map((c) => el("pre", { class: "call" }, `→ ${c.function?.name}(${c.function?.arguments})`)))));
  if (!messages.length) $("conversation").append(el("p", { class: "note" }, "the agent reported no messages"));
}

function whenShown(node, load) {  // run load() once node nears the viewport
  const seen = new IntersectionObserver((entries) => entries.forEach((e) => {
    if (e.isIntersecting) { seen.unobserve(e.target); load(e.target).catch(showError); }
  }), { rootMargin: "400px" });
  seen.observe(node);
}

function drawTurns(doc, i) {
  const box = $("turns");
  box.replaceChildren();
  if (!doc.turns.length) { box.append(el("p", { class: "note" }, "no trainable turns were captured for this rollout")); return; }
  for (const t of doc.turns) {
    const total = t.prompt_tokens + t.completion_tokens;
    const node = el("div", { class: "turn", id: `turn-${t.j}` },
      el("div", { class: "turn-head" }, `turn ${t.j} · call ${t.index} · policy version ${fmt(t.version)} (${fmt(t.model)}) · ` +
        `${t.prompt_tokens} prompt + ${t.completion_tokens} sampled tokens, ${t.trained} trained · finish ${fmt(t.finish_reason)}` +
        (t.parent != null ? ` · continues turn ${t.parent} (its first ${t.start} tokens)` : " · a root") +
        (t.root_break ? ` (${t.root_break.reason}: its prompt leaves turn ${t.j - 1}'s at token ${t.root_break.at}` +
          `, ${t.root_break.at >= t.root_break.prompt_tokens ? "inside what it sampled" : "before what it sampled"})` : "")),
      el("div", { class: "tokens", "data-total": total }));
    box.append(node);
    whenShown(node, (target) => loadTurn(target, doc, i));
  }
}

async function loadTurn(node, doc, i) {
  const t = doc.turns[node.id.slice(5)], total = t.prompt_tokens + t.completion_tokens, size = doc.chunk;
  const last = Math.max(0, Math.ceil(total / size) - 1);
  const first = Math.max(Math.floor(t.start / size), last - 2);  // what is new in this turn, at most 3 pieces
  const area = node.querySelector(".tokens");
  for (let c = first; c <= last; c++) area.append(await tokens(i, t, c));
  node.dataset.loaded = "true";
  if (first > 0) {
    let next = first - 1;
    const button = el("button", { class: "earlier-button" }, "");
    const label = () => { button.textContent = `show earlier context (${next * size + size} more tokens)`; };
    label();
    button.addEventListener("click", async () => {
      area.prepend(await tokens(i, t, next));
      next -= 1;
      if (next < 0) button.remove(); else label();
    });
    node.insertBefore(button, area);
  }
}

async function tokens(i, turn, chunk) {
  const d = await get(`${state.run}/tokens/${i}/${turn.j}/${chunk}`);
  const piece = el("span", { class: "chunk" });
  const earlier = turn.sampled_spans.slice(0, -1);
  d.text.forEach((text, k) => {
    const pos = d.start + k, span = el("span", { class: "tok", "data-pos": pos });
    span.textContent = text;
    if (pos >= d.prompt) {
      span.classList.add("sampled");
      span.style.background = `hsl(${Math.round(120 * Math.exp(d.logp[k]))},75%,82%)`;
    } else span.classList.add(earlier.some(([a, b]) => pos >= a && pos < b) ? "earlier" : "context");
    if (d.mask[k] === 1) span.classList.add("trained");
    piece.append(span);
  });
  piece.addEventListener("mouseover", (ev) => {
    const pos = ev.target.dataset?.pos;
    if (pos === undefined) return;
    const k = pos - d.start, sampled = pos >= d.prompt;
    $("tokinfo").textContent = `turn ${turn.j} · token ${pos} · id ${d.ids[k]} · ${JSON.stringify(d.text[k])} · ` +
      (sampled ? `sampled by policy version ${fmt(turn.version)}, behaviour logprob ${d.logp[k]} (p ${Math.exp(d.logp[k]).toFixed(3)})`
        : "prompt context") + ` · loss mask ${d.mask[k]}`;
  });
  return piece;
}

async function openRollout(i, turn) {
  const doc = await get(`${state.run}/rollout/${i}`);
  const r = doc.row, rec = doc.record;
  $("rollout").hidden = false;
  $("rollout-title").textContent = `Rollout ${i}: ${r.task} (${r.episode_id})`;
  $("rollout-facts").replaceChildren(facts([["status", r.status], ["why", r.reason], ["reward", r.reward],
    ["turns", r.turns], ["calls captured", doc.calls.length], ["tool calls", r.tool_calls], ["invalid tool calls", r.invalid_tool_calls],
    ["tool failures", r.tool_failures], ["policy versions", r.policy_versions], ["agent exit", rec.agent_exit], ["seconds", r.seconds]]));
  document.querySelectorAll("#rollout-table tr.open").forEach((tr) => tr.classList.remove("open"));
  document.querySelector(`#rollout-table tr[data-rollout="${i}"]`)?.classList.add("open");
  drawGraph(doc.calls);
  drawTurns(doc, i);
  $("conversation").replaceChildren(el("p", { class: "note" }, "loading the conversation ..."));
  whenShown($("conversation"), async () => drawMessages((await get(`${state.run}/messages/${i}`)).messages));
  const terms = Object.entries(rec.reward_terms || {}).map(([k, v]) => `  ${k}: ${v === null ? "None" : v}`);
  $("verifier").textContent = [rec.verifier_detail && `reward from: ${rec.verifier_detail}`,
    terms.length && `reward functions (summed, None skipped):\n${terms.join("\n")}`, rec.verifier_output]
    .filter(Boolean).join("\n\n") || "no verifier output recorded";
  (turn != null ? $(`turn-${turn}`) : $("rollout")).scrollIntoView();
}

// ---------------------------------------------------------------- wiring: #RUN or #RUN/ROLLOUT or #RUN/ROLLOUT/TURN
const state = { index: null, run: null };

async function openRun(key) {
  state.run = key;
  $("run").value = key;
  const [overview, rollouts] = await Promise.all([get(`${key}/overview`), get(`${key}/rollouts`)]);
  $("tokenizer").textContent = overview.tokenizer ? `tokens decoded with ${overview.tokenizer}`
    : "no tokenizer found in the run folder: token ids are shown (pass --model DIR)";
  const s = overview.summary || {};
  $("summary").replaceChildren(facts(Object.entries(s).filter(([, v]) => typeof v !== "object" || v === null || Array.isArray(v))
    .map(([k, v]) => [k, Array.isArray(v) ? (v.length ? v.map((x) => (typeof x === "object" ? JSON.stringify(x) : x)).join("; ") : "none") : v])));
  $("eval").textContent = overview.eval_table ? "the evaluation's table (summary.json)" : "";
  drawCharts(overview.metrics);
  drawSteps(overview.metrics);
  drawRollouts(rollouts.rows);
  $("rollout").hidden = true;
}

async function route() {
  try {
    const [run, rollout, turn] = location.hash.slice(1).split("/");
    const key = state.index.runs.some((r) => r.key === run) ? run : state.index.runs[0].key;
    if (key !== state.run) await openRun(key);
    if (rollout !== undefined && rollout !== "") await openRollout(Number(rollout), turn);
    else $("rollout").hidden = true;
  } catch (err) { showError(err); }
}

async function start() {
  try {
    window.DataTable = window.DataTablesBundle.default;
    state.index = await get("index");
    $("title").textContent = `run viewer · ${state.index.name}`;
    document.title = `${state.index.name} · harness-trainer`;
    $("run").replaceChildren(...state.index.runs.map((r) => el("option", { value: r.key }, `${r.name} (${r.rollouts} rollouts)`)));
    $("run").addEventListener("change", () => { location.hash = $("run").value; });
    const table = state.index.proof_table;
    if (table) {
      $("proof").hidden = false;
      const cols = ["wins", "rollouts", "tries_per_win", "invalid_tool_calls", "timeouts", "unscorable", "mean_reward"];
      $("proof-table").replaceChildren(el("table", { class: "facts" }, el("tr", {}, el("th", {}, "model"), cols.map((c) => el("th", {}, c))),
        Object.entries(table).map(([name, s]) => el("tr", {}, el("td", {}, name), cols.map((c) => el("td", {}, fmt(s[c])))))));
    }
    window.addEventListener("hashchange", route);
    await route();
  } catch (err) { showError(err); }
}
start();
