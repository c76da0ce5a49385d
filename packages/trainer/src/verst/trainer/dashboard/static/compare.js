// verst dashboard, Compare tab: the runs side by side — name, state, steps, total wall time;
// final and best values of the reward metrics (and the final value of the others chosen);
// the config fields that differ (highlighted), and every field on request.
"use strict";

const COMPARE_FINAL = [/reward/, /^train\/loss$/, /logprob_mismatch$/, /mismatch_tokens$/, /response_len_mean$/, /^train\/kl/, /^time\/step_s$/];

function cellValue(v) {
  if (v == null) return '<span class="muted">–</span>';
  return esc(typeof v === "number" ? fmt(v) : typeof v === "string" ? v : JSON.stringify(v));
}

async function renderCompare() {
  const c = await api("/api/compare");
  const runs = c.runs;
  const head = `<tr><th>field</th>${runs.map((r) => `<th data-run="${r.id}">${esc(runLabel(r.id))}</th>`).join("")}</tr>`;
  const row = (key, cells, cls = "") => `<tr class="${cls}" data-key="${esc(key)}"><td>${esc(key)}</td>${cells.map((v, i) => `<td data-run="${runs[i].id}" data-value="${esc(v == null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v))}">${cellValue(v)}</td>`).join("")}</tr>`;
  const info = [
    row("state", runs.map((r) => r.state)),
    row("steps", runs.map((r) => `${r.step} / ${r.total_steps ?? "?"}`)),
    row("wall time", runs.map((r) => (r.wall_s == null ? null : duration(r.wall_s)))),
    row("folder", runs.map((r) => r.folder)),
  ].join("");
  const metrics = c.metrics.filter((m) => COMPARE_FINAL.some((re) => re.test(m)));
  const results = metrics.flatMap((m) => {
    const stats = runs.map((r) => r.metrics[m] || null);
    const out = [row(`${m} · final`, stats.map((s) => (s ? s.final : null)))];
    if (stats.some((s) => s && s.best != null)) out.push(row(`${m} · best (step)`, stats.map((s) => (s && s.best != null ? `${fmt(s.best)} (${s.best_step})` : null))));
    return out;
  }).join("");
  const diff = new Set(c.differing);
  const keys = state.compareAll ? c.config_keys : c.differing;
  const config = keys.map((k) => row(k, runs.map((r) => r.config[k] ?? null), diff.has(k) ? "diff" : "")).join("");
  $("#tab-compare").innerHTML = `
    <p class="muted">${runs.length} run(s) · ${c.differing.length} config field(s) differ (highlighted) ·
      <label><input type="checkbox" id="compare-all" ${state.compareAll ? "checked" : ""}> show all ${c.config_keys.length} fields</label></p>
    <div class="table-scroll"><table id="compare-table">
      <tbody class="compare-runs">${head}${info}</tbody>
      <tbody class="compare-results"><tr><th colspan="${runs.length + 1}">results: last logged value; best = highest, with its step</th></tr>${results}</tbody>
      <tbody class="compare-config"><tr><th colspan="${runs.length + 1}">config${state.compareAll ? "" : " (differing fields)"}</th></tr>${config || `<tr><td colspan="${runs.length + 1}" class="muted">no differences</td></tr>`}</tbody>
    </table></div>`;
  $("#compare-all").addEventListener("change", (e) => { state.compareAll = e.target.checked; renderCompare(); });
  document.body.dataset.compare = String(runs.length);
}
