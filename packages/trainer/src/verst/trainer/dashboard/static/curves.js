// verst dashboard, Curves tab: one panel per metric prefix (rollout/, train/, eval/, time/, sync/,
// ...), collapsible; one chart per metric with every ticked run overlaid; x-axis by step, time
// since the run's start or wall-clock time; log scale; TensorBoard-style smoothing; hover shows
// every run at that x; CSV and PNG export per chart. Uses app.js's state, api, $, $$, esc.
"use strict";

const OPEN_GROUPS = ["rollout", "eval"];
const OTHER_GROUP = "other";

function metricGroup(name) {
  const i = name.indexOf("/");
  return i > 0 ? name.slice(0, i) : OTHER_GROUP;
}

function smooth(ys, alpha) {
  // TensorBoard-style exponential moving average, debiased at the start
  if (!alpha) return ys;
  let acc = 0, n = 0;
  return ys.map((y) => {
    if (y == null) return null;
    n += 1;
    acc = alpha * acc + (1 - alpha) * y;
    return acc / (1 - Math.pow(alpha, n));
  });
}

function integerTickStep(span, target = 8) {
  // a 1-2-5 step of at least 1, so step ticks never fall on fractions
  const raw = Math.max(1, span / target);
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function xValues(series, mode, t0) {
  if (mode === "step") return series.x;
  const base = t0 ?? series.t.find((t) => t != null);
  if (mode === "wall") return series.t.map((t) => (t == null ? null : new Date(t * 1000)));
  return series.t.map((t) => (t == null || base == null ? null : t - base));
}

function xAxis(mode, traces) {
  if (mode === "wall") return { title: { text: "wall time" }, type: "date" };
  if (mode === "relative") return { title: { text: "seconds since the run started" }, rangemode: "tozero" };
  const xs = traces.flatMap((t) => t.x).filter((v) => v != null);
  const span = xs.length ? Math.max(...xs) - Math.min(...xs) : 1;
  return { title: { text: "step" }, tickmode: "linear", tick0: 0, dtick: integerTickStep(span), tickformat: "d" };
}

function curveTraces(name, data) {
  const traces = [];
  for (const d of data) {
    const s = d.series[name];
    if (!s) continue;
    const x = xValues(s, state.curveX, d.t0);
    if (state.smoothing) traces.push({ x, y: s.y, mode: "lines", line: { width: 1 }, opacity: 0.25, name: `${d.label} (raw)`, hoverinfo: "skip", showlegend: false, legendgroup: d.label });
    traces.push({ x, y: smooth(s.y, state.smoothing), mode: "lines+markers", marker: { size: 3 }, name: d.label, legendgroup: d.label });
  }
  return traces;
}

function curveCsv(name, data) {
  // the raw points of every run (and the smoothed value when smoothing is on)
  const head = ["run", "step", "wall_time", "value"].concat(state.smoothing ? ["smoothed"] : []);
  const lines = [head.join(",")];
  const quote = (v) => (/[",\n]/.test(String(v)) ? `"${String(v).replace(/"/g, '""')}"` : String(v));
  for (const d of data) {
    const s = d.series[name];
    if (!s) continue;
    const sm = smooth(s.y, state.smoothing);
    s.x.forEach((x, i) => lines.push([quote(d.label), x, s.t[i] ?? "", s.y[i] ?? ""].concat(state.smoothing ? [sm[i] ?? ""] : []).join(",")));
  }
  return lines.join("\n") + "\n";
}

function download(filename, href) {
  const a = document.createElement("a");
  a.href = href; a.download = filename; document.body.appendChild(a); a.click(); a.remove();
}

const fileStem = (name) => name.replace(/[^A-Za-z0-9._-]+/g, "_");
const purge = (el) => window.Plotly && window.Plotly.purge(el);

function chartCard(box, name) {
  let card = Array.from(box.children).find((c) => c.dataset.metric === name);
  if (card) return card;
  card = document.createElement("div");
  card.className = "chart-card";
  card.dataset.metric = name;
  card.innerHTML = `<div class="chart-bar"><b>${esc(name)}</b><span><button class="export-csv" title="the points as CSV">CSV</button> <button class="export-png" title="this chart as PNG">PNG</button></span></div><div class="chart" data-key="curve-${esc(name)}"></div>`;
  card.querySelector(".export-csv").addEventListener("click", () => {
    const csv = curveCsv(name, state.curveData);
    download(`${fileStem(name)}.csv`, URL.createObjectURL(new Blob([csv], { type: "text/csv" })));
  });
  card.querySelector(".export-png").addEventListener("click", async () => {
    const el = card.querySelector(".chart");
    download(`${fileStem(name)}.png`, await (await plotly()).toImage(el, { format: "png", width: el.clientWidth || 700, height: 300 }));
  });
  box.appendChild(card);
  return card;
}

function groupPanel(root, group, names) {
  let panel = root.querySelector(`details[data-group="${CSS.escape(group)}"]`);
  if (!panel) {
    panel = document.createElement("details");
    panel.className = "panel";
    panel.dataset.group = group;
    panel.open = state.openGroups.has(group);
    panel.innerHTML = `<summary></summary><div class="panel-charts"></div>`;
    panel.addEventListener("toggle", () => {
      if (panel.open === state.openGroups.has(group)) return;
      panel.open ? state.openGroups.add(group) : state.openGroups.delete(group);
      renderCurves();
    });
    root.appendChild(panel);
  }
  panel.querySelector("summary").textContent = `${group === OTHER_GROUP ? "(no prefix)" : group + "/"} — ${names.length} metric${names.length === 1 ? "" : "s"}`;
  return panel;
}

async function renderCurves() {
  if (!state.overlay.size) state.overlay.add(state.run);
  const ids = [...state.overlay].sort((a, b) => a - b);
  const lists = await Promise.all(ids.map((id) => api(runPath(id, "curves"), { names: "" })));
  const filter = $("#metric-filter").value.toLowerCase();
  const names = [...new Set(lists.flatMap((l) => l.metrics))].sort().filter((n) => n.toLowerCase().includes(filter));
  const groups = {};
  for (const n of names) (groups[metricGroup(n)] ||= []).push(n);
  const order = Object.keys(groups).sort((a, b) => (a === OTHER_GROUP) - (b === OTHER_GROUP) || a.localeCompare(b));
  if (!state.openGroupsSet) {
    state.openGroups = new Set(OPEN_GROUPS.filter((g) => groups[g]));
    if (!state.openGroups.size && order.length) state.openGroups.add(order[0]);
    state.openGroupsSet = true;
  }
  renderRunBoxes();
  $("#metric-groups-list").textContent = `${names.length} metrics in ${order.length} panels`;
  const root = $("#curve-panels");
  Array.from(root.children).forEach((el) => { if (!groups[el.dataset.group]) { el.querySelectorAll(".chart").forEach(purge); el.remove(); } });
  const wanted = order.filter((g) => state.openGroups.has(g)).flatMap((g) => groups[g]);
  const data = await Promise.all(ids.map((id) => api(runPath(id, "curves"), { names: wanted.join(",") })));
  data.forEach((d, i) => (d.label = runLabel(ids[i])));
  state.curveData = data;
  const Plotly = wanted.length ? await plotly() : null;
  const drawn = [];
  for (const g of order) {
    const panel = groupPanel(root, g, groups[g]);
    root.appendChild(panel);  // keep the panels in order
    const box = panel.querySelector(".panel-charts");
    const keep = new Set(state.openGroups.has(g) ? groups[g] : []);
    Array.from(box.children).forEach((c) => { if (!keep.has(c.dataset.metric)) { purge(c.querySelector(".chart")); c.remove(); } });
    for (const name of keep) {
      const card = chartCard(box, name);
      const traces = curveTraces(name, data);
      await Plotly.react(card.querySelector(".chart"), traces, {
        margin: { l: 55, r: 10, t: 8, b: 40 }, hovermode: "x unified", xaxis: { ...xAxis(state.curveX, traces), zeroline: false },
        yaxis: { type: state.curveLog ? "log" : "linear" }, showlegend: ids.length > 1, legend: { orientation: "h", y: -0.25 },
      }, { displaylogo: false, responsive: true });
      drawn.push(name);
    }
  }
  document.body.dataset.curves = drawn.join(",");
}

function renderRunBoxes() {
  $("#curve-runs").innerHTML = "<b>runs</b>" + state.runs.map((r) =>
    `<label><input type="checkbox" data-run="${r.id}" ${state.overlay.has(r.id) ? "checked" : ""}> ${esc(runLabel(r.id))}</label>`).join("");
  $$("#curve-runs input").forEach((el) => el.addEventListener("change", () => {
    const id = Number(el.dataset.run);
    el.checked ? state.overlay.add(id) : state.overlay.delete(id);
    renderCurves();
  }));
}

function bindCurveControls() {
  $("#metric-filter").addEventListener("input", () => renderCurves());
  $("#smoothing").addEventListener("input", (e) => { state.smoothing = Number(e.target.value); $("#smoothing-value").textContent = e.target.value; renderCurves(); });
  $("#curve-x").addEventListener("change", (e) => { state.curveX = e.target.value; renderCurves(); });
  $("#curve-log").addEventListener("change", (e) => { state.curveLog = e.target.checked; renderCurves(); });
}
