// verst dashboard: overview, curves (curves.js), rollout timeline, samples and their full
// trajectories (trajectory.js), and the runs' comparison (compare.js) of one or more runs.
// Served by `verst dashboard` (polls the JSON views every POLL_MS) or inlined by `verst report`
// (the views are embedded in #verst-data; no network at all). The timeline draws its own SVG
// (timeline.js); the curves and the trajectory chart use plotly.js, loaded the first time one
// is drawn (`plotly()`): its 4.8 MB take seconds to evaluate, so the page never waits for it
// before its first view.
"use strict";

const POLL_MS = 2000;
const PAGE = 50;
const STATUS_COLORS = {
  completed: "#2ca02c", truncated: "#ff7f0e", aborted: "#8c8c8c", failed: "#d62728",
  cancelled: "#9467bd", unfinished: "#e377c2", running: "#17becf",
};

const EMBED = (() => {
  const el = document.getElementById("verst-data");
  return el ? JSON.parse(el.textContent) : null;
})();

const state = {
  runs: [], run: 0, tab: "overview", steps: null, step: null, followLatest: true,
  split: "train", q: "", offset: 0, overlay: new Set(), smoothing: 0, curveX: "step", curveLog: false,
  openGroups: new Set(), openGroupsSet: false, curveData: [], sort: "", desc: false, statuses: new Set(),
  rewardMin: "", rewardMax: "", tokenColor: "none", compareAll: false,
};

function runLabel(id) {
  // run.name; the folder too when two runs share a name
  const r = state.runs.find((x) => x.id === id);
  if (!r) return String(id);
  const twins = state.runs.filter((x) => x.name === r.name).length > 1;
  return twins ? `${r.name} (${r.folder})` : r.name;
}

const $ = (sel) => document.querySelector(sel);
const $$ = (sel) => Array.from(document.querySelectorAll(sel));
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const fmt = (v, d = 4) => (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(d)) : v == null ? "–" : String(v));

function duration(s) {
  if (s == null) return "–";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

// ------------------------------------------------------------------ data access

async function api(path, params = {}) {
  if (EMBED) return embedded(path, params);
  const qs = new URLSearchParams(params).toString();
  const resp = await fetch(path + (qs ? "?" + qs : ""), { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: ${resp.status} ${await resp.text()}`);
  return resp.json();
}

function embedded(path, params) {
  const views = EMBED.views;
  if (path.endsWith("/timeline")) {
    const v = views[`${path}?step=${params.step}`];
    return v || { rows: [], total: 0, offset: 0, limit: 0, step: params.step, summary: { attempts: 0, status_counts: {} } };
  }
  if (path.endsWith("/samples")) {
    const v = views[`${path}?step=${params.step}&split=${params.split}`] || { items: [], statuses: [], reward_range: null };
    const items = querySamples(v.items, params, v.reward_key);
    const offset = Number(params.offset || 0), limit = Number(params.limit || PAGE);
    return { ...v, step: params.step, split: params.split, total: items.length, offset, limit, items: items.slice(offset, offset + limit) };
  }
  if (path.endsWith("/trajectory")) {
    const v = views[`${path}?step=${params.step}&split=${params.split}&sample=${params.sample}`];
    return v || { found: false };
  }
  if (path.endsWith("/curves")) {
    const v = views[path];
    if (!params.names) return v;
    const wanted = params.names.split(",");
    return { ...v, series: Object.fromEntries(wanted.filter((n) => v.series[n]).map((n) => [n, v.series[n]])) };
  }
  return views[path];
}

const runPath = (id, view) => `/api/runs/${id}/${view}`;

// the latest time of each milestone (read by benchmarks/dashboard_load.py; one entry per name)
const mark = (name) => { performance.clearMarks(`verst:${name}`); performance.mark(`verst:${name}`); };

let plotlyLoad = null;
function plotly() {
  // plotly.js, loaded once on first use (a report has it inline already)
  if (window.Plotly) return Promise.resolve(window.Plotly);
  const inert = document.getElementById("plotly-src");  // a report's inline copy
  if (inert) {
    const s = document.createElement("script");
    s.textContent = inert.textContent;
    document.head.appendChild(s);  // runs now
    inert.remove();
    return Promise.resolve(window.Plotly);
  }
  plotlyLoad ||= new Promise((resolve, reject) => {
    const s = document.createElement("script");
    s.src = "static/plotly.min.js";
    mark("plotly-start");
    s.onload = () => { mark("plotly-ready"); resolve(window.Plotly); };
    s.onerror = () => { plotlyLoad = null; reject(new Error("could not load static/plotly.min.js")); };
    document.head.appendChild(s);
  });
  return plotlyLoad;
}

// The samples query of samples_view.py (the report's page applies it to its embedded rows).
function scalarReward(r, key) {
  let v = r.reward;
  if (v && typeof v === "object") v = key != null && typeof v[key] === "number" ? v[key] : Object.values(v).find((x) => typeof x === "number");
  return typeof v === "number" ? v : null;
}

function sampleKey(r, col, key) {
  if (col === "group") return r.group_index ?? null;
  if (col === "status") return r.status ?? null;
  if (col === "reward") return scalarReward(r, key);
  if (col === "advantage") return r.advantage ?? null;
  if (col === "tokens") return (r.prompt_tokens || 0) + (r.response_tokens || 0);
  if (col === "response_tokens") return r.response_tokens ?? null;
  if (col === "weight_version") return (r.weight_versions || []).length ? Math.max(...r.weight_versions) : null;
  if (col === "label") return r.label ?? null;
  return r.sample_index ?? null;
}

function querySamples(rows, params, key) {
  const q = (params.q || "").toLowerCase();
  if (q) rows = rows.filter((r) => [r.prompt, r.response, r.label, r.error, r.status].filter((x) => x != null).concat([JSON.stringify(r.reward ?? null)]).join(" ").toLowerCase().includes(q));
  const statuses = (params.status || "").split(",").filter(Boolean);
  if (statuses.length) rows = rows.filter((r) => statuses.includes(r.status));
  const lo = params.reward_min === "" || params.reward_min == null ? -Infinity : Number(params.reward_min);
  const hi = params.reward_max === "" || params.reward_max == null ? Infinity : Number(params.reward_max);
  if (lo !== -Infinity || hi !== Infinity) rows = rows.filter((r) => { const v = scalarReward(r, key); return v != null && v >= lo && v <= hi; });
  const col = params.sort || "sample";
  const cmp = (a, b) => (a < b ? -1 : a > b ? 1 : 0);
  const present = rows.filter((r) => sampleKey(r, col, key) != null), missing = rows.filter((r) => sampleKey(r, col, key) == null);
  present.sort((a, b) => cmp(sampleKey(a, col, key), sampleKey(b, col, key)) || cmp(a.sample_index || 0, b.sample_index || 0));
  if (params.desc === "1") present.reverse();
  return present.concat(missing);
}

// ------------------------------------------------------------------ tabs and run selection

function showTab(tab) {
  state.tab = tab;
  $$(".tab").forEach((el) => el.classList.toggle("active", el.id === `tab-${tab}`));
  $$("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === tab));
  return renderTab();
}

async function renderTab() {
  if (state.tab === "overview") return renderOverview();
  if (state.tab === "curves") return renderCurves();
  if (state.tab === "timeline") return renderTimeline();
  if (state.tab === "samples") return renderSamples();
  if (state.tab === "compare") return renderCompare();
}

// ------------------------------------------------------------------ overview

function lastRewardCards(last) {
  // the last logged reward of the rollouts and of each eval set
  const keys = Object.keys(last || {}).filter((k) => /reward_mean$|^eval\/.*reward/.test(k)).slice(0, 3);
  return keys.map((k) => `<div class="card"><div class="k">last ${esc(k)}</div><div class="v" data-reward-key="${esc(k)}">${fmt(last[k].value)}</div><div class="k">at step ${last[k].step}</div></div>`).join("");
}

async function renderOverview() {
  const o = await api(runPath(state.run, "overview"));
  const s = o.status;
  const total = s.total_steps ?? "?";
  const pct = s.total_steps ? Math.min(100, (100 * s.step) / s.total_steps) : 0;
  const phases = Object.entries(s.phase_seconds || {}).sort((a, b) => b[1] - a[1]);
  const evalKeys = [...new Set(o.eval.flatMap((e) => Object.keys(e).filter((k) => k !== "step")))];
  const health = o.files.map((f) => `<tr><td class="file">${esc(f.file)}</td><td>${f.lines}</td>
      <td class="${f.malformed ? "warn" : ""}">${f.malformed}${f.first_malformed_line ? ` (first at line ${f.first_malformed_line})` : ""}</td>
      <td>${f.partial_last_line ? "yes" : "no"}</td></tr>`).join("");
  $("#tab-overview").innerHTML = `
    <div class="cards">
      <div class="card"><div class="k">status</div><div class="v"><span id="overview-state" class="badge state-${esc(s.state)}">${esc(s.state.replace("_", " "))}</span></div>
        ${s.phase ? `<div class="k">phase: <b id="overview-phase">${esc(s.phase)}</b></div>` : ""}</div>
      <div class="card"><div class="k">step</div><div class="v" id="overview-step">${s.step} / ${total}</div>
        <div class="progress"><div style="width:${pct}%"></div></div></div>
      <div class="card"><div class="k">${s.state === "running" ? "time left" : "total wall time"}</div><div class="v" id="overview-eta">${s.state === "running" ? duration(s.eta_s) : duration(s.wall_s)}</div>
        ${s.state === "running" && s.wall_s != null ? `<div class="k">running for ${duration(s.wall_s)}</div>` : ""}</div>
      ${lastRewardCards(o.last_rewards)}
      <div class="card"><div class="k">lifecycle events</div><div class="v" id="overview-events">${o.n_events}</div></div>
      <div class="card"><div class="k">samples recorded</div><div class="v" id="overview-samples">${o.n_samples}</div>
        <div class="k">${o.n_trajectories} full trajectories</div></div>
    </div>
    ${s.note ? `<p class="warn">${esc(s.note)}</p>` : ""}
    ${s.error ? `<p class="warn" id="overview-error">error: ${esc(s.error)}</p>` : ""}
    <div class="grid2">
      <div><h3>Time per phase</h3><table id="overview-phases"><tr><th>phase</th><th>seconds</th><th>share</th></tr>
        ${phases.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${v.toFixed(1)}</td><td>${(100 * v / Math.max(1e-9, phases.reduce((a, p) => a + p[1], 0))).toFixed(0)}%</td></tr>`).join("")}</table></div>
      <div><h3>Eval rewards</h3>${o.eval.length ? `<div class="table-scroll"><table id="overview-eval"><tr><th>step</th>${evalKeys.map((k) => `<th>${esc(k)}</th>`).join("")}</tr>
        ${o.eval.map((e) => `<tr><td>${e.step}</td>${evalKeys.map((k) => `<td>${fmt(e[k])}</td>`).join("")}</tr>`).join("")}</table></div>` : '<p class="muted">no evaluation yet</p>'}</div>
      <div><h3>Config</h3><table id="overview-config" class="kv">${Object.entries(o.config_summary).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(JSON.stringify(v))}</td></tr>`).join("")}</table>
        ${o.config_error ? `<p class="warn">${esc(o.config_error)}</p>` : ""}
        <details><summary>full config (${Object.keys(o.config).length} fields)</summary><pre>${esc(Object.entries(o.config).map(([k, v]) => `${k} = ${JSON.stringify(v)}`).join("\n"))}</pre></details></div>
      <div><h3>Files</h3><table id="overview-files"><tr><th>file</th><th>lines</th><th>malformed (skipped)</th><th>partial last line</th></tr>${health}</table>
        <p class="muted">${esc(o.path)}</p></div>
    </div>`;
}

// ------------------------------------------------------------------ steps

async function loadSteps(pending = null) {
  const s = await (pending || api(runPath(state.run, "steps")));
  const all = [...new Set([...s.timeline_steps.map((r) => r.step), ...s.sample_steps])].sort((a, b) => a - b);
  const latest = all.length ? all[all.length - 1] : null;
  if (state.step == null || (state.followLatest && latest != null)) state.step = latest;
  state.steps = { ...s, all };
  for (const sel of $$(".step-select")) {
    if (sel.options.length !== all.length || sel.dataset.last !== String(latest)) {
      sel.innerHTML = all.map((n) => `<option value="${n}">${n}</option>`).join("");
      sel.dataset.last = String(latest);
    }
    if (state.step != null) sel.value = String(state.step);
  }
  const splits = s.splits.length ? s.splits : ["train"];
  const split = $("#samples-split");
  if (split.options.length !== splits.length) split.innerHTML = splits.map((n) => `<option>${esc(n)}</option>`).join("");
  if (!splits.includes(state.split)) state.split = splits.includes("train") ? "train" : splits[0];
  split.value = state.split;
  return s;
}

function setStep(step) {
  if (step == null) return;
  const all = state.steps ? state.steps.all : [];
  state.step = step;
  state.followLatest = all.length > 0 && step === all[all.length - 1];
  state.offset = 0;
  $$(".step-select").forEach((sel) => (sel.value = String(step)));
  return renderTab();
}

function stepBy(delta) {
  const all = state.steps ? state.steps.all : [];
  const i = all.indexOf(state.step);
  const next = all[Math.max(0, Math.min(all.length - 1, i + delta))];
  return setStep(next);
}

// ------------------------------------------------------------------ samples

function rewardCell(r) {
  if (r == null) return "–";
  if (typeof r === "object") return Object.entries(r).map(([k, v]) => `${esc(k)}=${fmt(v)}`).join("<br>");
  return fmt(r);
}

function sampleParams() {
  return {
    q: state.q, sort: state.sort, desc: state.desc ? "1" : "0", status: [...state.statuses].join(","),
    reward_min: state.rewardMin, reward_max: state.rewardMax,
  };
}

function renderStatusFilter(statuses) {
  const box = $("#samples-status-filter");
  const key = statuses.join(",");
  if (box.dataset.statuses === key) return;
  box.dataset.statuses = key;
  box.innerHTML = "status " + statuses.map((st) => `<label class="inline"><input type="checkbox" data-status="${esc(st)}" ${state.statuses.has(st) ? "checked" : ""}> ${esc(st)}</label>`).join(" ");
  $$("#samples-status-filter input").forEach((el) => el.addEventListener("change", () => {
    el.checked ? state.statuses.add(el.dataset.status) : state.statuses.delete(el.dataset.status);
    state.offset = 0; renderSamples();
  }));
}

function sampleRow(s) {
  const adv = s.advantage == null ? "–" : fmt(s.advantage);
  const versions = s.weight_versions || [];
  return `<tr data-sample="${s.sample_index}" data-group="${s.group_index}" data-status="${esc(s.status)}" data-reward="${typeof s.reward === "number" ? s.reward : ""}" data-advantage="${s.advantage ?? ""}">
      <td>g${s.group_index} / s${s.sample_index}${s.attempt ? ` (attempt ${s.attempt})` : ""}</td>
      <td><span style="color:${STATUS_COLORS[s.status] || "#444"}">${esc(s.status)}</span></td>
      <td class="reward">${rewardCell(s.reward)}</td><td class="advantage">${adv}</td>
      <td class="text label">${esc(s.label ?? "")}</td>
      <td>${esc(versions.length > 3 ? `${versions[0]}…${versions[versions.length - 1]}` : versions.join(", "))}</td>
      <td>${s.prompt_tokens} + ${s.response_tokens}</td>
      <td class="text">${esc(s.prompt)}</td><td class="text">${esc(s.response)}</td>
      <td class="text warn">${esc(s.error || "")}</td>
      <td>${s.has_trajectory ? `<button class="open-trajectory" data-sample="${s.sample_index}">view tokens</button>` : '<span class="muted">preview only</span>'}</td></tr>`;
}

async function renderSamples() {
  if (!state.steps) await loadSteps();
  const step = state.step;
  if (step == null) { $("#samples-count").textContent = "no samples yet"; return; }
  const query = sampleParams();
  const p = await api(runPath(state.run, "samples"), { step, split: state.split, offset: state.offset, limit: PAGE, ...query });
  if (step !== state.step || JSON.stringify(query) !== JSON.stringify(sampleParams())) return;  // superseded
  renderStatusFilter(p.statuses || []);
  $("#samples-table tbody").innerHTML = p.items.map(sampleRow).join("");
  $$("#samples-table thead th[data-sort]").forEach((th) => {
    th.classList.toggle("sorted", th.dataset.sort === (state.sort || "sample"));
    th.dataset.dir = th.dataset.sort === (state.sort || "sample") ? (state.desc ? "desc" : "asc") : "";
  });
  $$("#samples-table .open-trajectory").forEach((b) => b.addEventListener("click", () => openTrajectory(step, state.split, Number(b.dataset.sample))));
  const end = Math.min(p.total, p.offset + p.items.length);
  const range = p.reward_range ? ` · rewards ${fmt(p.reward_range[0])} … ${fmt(p.reward_range[1])}` : "";
  $("#samples-count").textContent = (p.total ? `${p.offset + 1}–${end} of ${p.total} samples` : "no matching samples") + range;
  $("#samples-count").dataset.total = String(p.total);
  $("#samples-prev").disabled = p.offset <= 0;
  $("#samples-next").disabled = end >= p.total;
  document.body.dataset.samplesStep = String(step);
  document.body.dataset.samplesQuery = JSON.stringify(query);
}

function bindSampleControls() {
  $("#samples-split").addEventListener("change", (e) => { state.split = e.target.value; state.offset = 0; renderSamples(); });
  let timer = null;
  const later = (fn) => { fn(); clearTimeout(timer); timer = setTimeout(() => { state.offset = 0; renderSamples(); }, 200); };
  $("#sample-search").addEventListener("input", (e) => later(() => (state.q = e.target.value)));
  $("#reward-min").addEventListener("input", (e) => later(() => (state.rewardMin = e.target.value)));
  $("#reward-max").addEventListener("input", (e) => later(() => (state.rewardMax = e.target.value)));
  $$("#samples-table thead th[data-sort]").forEach((th) => th.addEventListener("click", () => {
    const col = th.dataset.sort;
    if ((state.sort || "sample") === col) state.desc = !state.desc; else { state.sort = col; state.desc = false; }
    state.offset = 0; renderSamples();
  }));
  $("#samples-prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); renderSamples(); });
  $("#samples-next").addEventListener("click", () => { state.offset += PAGE; renderSamples(); });
}

// ------------------------------------------------------------------ live updates

async function poll() {
  try {
    const before = state.steps ? state.steps.all.join(",") : "";
    await loadSteps();
    const changed = state.steps.all.join(",") !== before;
    const live = state.steps.live;
    if (state.tab === "overview" || ((state.tab === "curves" || state.tab === "compare") && live) || changed || (state.followLatest && live)) await renderTab();
    else if (state.tab === "timeline") drawStepsChart();  // summaries still being computed come in
    $("#live-note").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("#live-note").textContent = `update failed: ${err.message}`;
  }
  setTimeout(poll, POLL_MS);
}

// ------------------------------------------------------------------ start

async function main() {
  mark("start");
  const firstSteps = api(runPath(state.run, "steps"));  // asked for alongside the run list
  firstSteps.catch(() => {});  // (a failure surfaces where it is awaited)
  state.runs = await api("/api/runs");
  $("#run-select").innerHTML = state.runs.map((r) => `<option value="${r.id}">${esc(runLabel(r.id))}</option>`).join("");
  $("#run-select").addEventListener("change", async (e) => {
    state.run = Number(e.target.value); state.steps = null; state.step = null; state.followLatest = true;
    await loadSteps(); renderTab();
  });
  $$("#tabs a").forEach((a) => a.addEventListener("click", (e) => { e.preventDefault(); history.replaceState(null, "", `#${a.dataset.tab}`); showTab(a.dataset.tab); }));
  $$(".step-select").forEach((sel) => sel.addEventListener("change", () => setStep(Number(sel.value))));
  $$(".step-prev").forEach((b) => b.addEventListener("click", () => stepBy(-1)));
  $$(".step-next").forEach((b) => b.addEventListener("click", () => stepBy(1)));
  bindSampleControls();
  bindCurveControls();
  let resized = null;  // the timeline's SVG is drawn to the window's width: redraw when it changes
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(() => state.tab === "timeline" && renderTimeline(), 200); });
  window.addEventListener("hashchange", () => { const t = location.hash.slice(1); if (t !== state.tab && $(`#tab-${t}`)) showTab(t); });
  if (state.runs.length > 1) state.runs.forEach((r) => state.overlay.add(r.id));
  await loadSteps(firstSteps);
  mark("steps");
  const tab = (location.hash || "#overview").slice(1);
  await showTab(["overview", "curves", "timeline", "samples", "compare"].includes(tab) ? tab : "overview");
  document.body.dataset.ready = "1";
  mark("ready");
  if (EMBED) $("#live-note").textContent = `report of ${state.runs.length} run(s), written ${EMBED.generated_at}`;
  else setTimeout(poll, POLL_MS);
}

main().catch((err) => {
  document.body.dataset.error = err.message;
  $("main").insertAdjacentHTML("afterbegin", `<p class="warn">dashboard error: ${esc(err.message)}</p>`);
});
