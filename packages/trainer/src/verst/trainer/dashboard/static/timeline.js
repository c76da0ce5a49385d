// verst dashboard, Timeline tab: one row per attempt of a step (queued, generating, scoring,
// sub-spans such as turns and tool calls; retries linked by a dotted line) and the per-step
// queue / generation / scoring chart. Drawn as plain SVG built in one string: a step's 2000
// attempts draw in milliseconds, and the tab needs no plotly.js (the Curves tab loads it on
// demand). Hover shows an attempt's times in a tooltip. Uses app.js's state, api, $, esc.
"use strict";

const MAX_ROW_LABELS = 80;
const SUB_COLORS = ["#1f3b73", "#b8860b", "#008b8b", "#8b4513", "#556b2f"];
const QUEUED_COLOR = "#d4d8de";
const SVG_NS = 'xmlns="http://www.w3.org/2000/svg"';
const hatch = (id, color) => `<pattern id="${id}" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="5" height="5" fill="${color}"/><line x1="0" y1="0" x2="0" y2="5" stroke="#fff" stroke-width="2"/></pattern>`;

function rowLabel(r) {
  const g = r.group == null ? "?" : r.group, s = r.sample == null ? "?" : r.sample;
  return `g${g} s${s} #${r.attempt}`;
}

function hoverText(r) {
  const queued = r.queued_end - r.start;
  const gen = r.gen.reduce((a, [s, e]) => a + (e - s), 0);
  const score = r.score_start == null ? 0 : r.end - r.score_start;
  let t = `<b>${rowLabel(r)}</b> — ${esc(r.status)}${r.finished ? "" : " (no attempt_end)"}<br>` +
    `queued ${queued.toFixed(3)} s · generating ${gen.toFixed(3)} s · scoring ${score.toFixed(3)} s<br>` +
    `start +${r.start.toFixed(3)} s, end +${r.end.toFixed(3)} s`;
  if (r.response_tokens != null) t += `<br>${r.response_tokens} response tokens`;
  if (r.retry_of != null) t += `<br>retry of attempt #${r.attempt - 1}`;
  if (r.error) t += `<br>error: ${esc(r.error)}${r.message ? ": " + esc(r.message) : ""}`;
  return t;
}

function niceStep(span, target = 8) {
  // a 1-2-5 tick step giving about `target` ticks over `span`
  const raw = Math.max(span, 1e-9) / target;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function ticks(lo, hi, target) {
  const step = niceStep(hi - lo, target);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function tooltip(svg, text) {
  // one tooltip per chart; `text(target, x, y)` gives the HTML for the element / point (in the
  // chart's coordinates) under the pointer, or null
  const tip = svg.parentElement.querySelector(".chart-tip") || svg.parentElement.appendChild(Object.assign(document.createElement("div"), { className: "chart-tip" }));
  svg.addEventListener("mousemove", (e) => {
    const at = svg.getBoundingClientRect();
    const html = text(e.target, e.clientX - at.left, e.clientY - at.top);
    if (html == null) { tip.hidden = true; return; }
    const box = svg.parentElement.getBoundingClientRect();
    tip.innerHTML = html; tip.hidden = false;
    tip.style.left = `${Math.min(e.clientX - box.left + 14, box.width - tip.offsetWidth - 4)}px`;
    tip.style.top = `${e.clientY - box.top + 14}px`;
  });
  svg.addEventListener("mouseleave", () => (tip.hidden = true));
}

function timelineGeometry(t, width) {
  // the x / y mapping of a step's rows (shared by the drawing and the hover lookup)
  const rows = t.rows, rowH = rows.length > 200 ? 8 : 18, left = 110, top = 40, right = 20;
  const xMax = Math.max(1e-3, ...rows.map((r) => Math.max(r.end, ...r.sub.map((s) => s.end))));
  const w = Math.max(100, width - left - right);
  return { rows, rowH, left, top, w, xMax, height: top + rowH * rows.length + 10, X: (v) => left + (Math.max(0, v) / xMax) * w };
}

function timelineSvg(t, g) {
  // one <path> per colour (a subpath per bar): a step's thousands of bars are a handful of
  // elements, so drawing and style recalculation stay cheap; `timelineHit` finds what is hovered
  const { rows, rowH, left, top, w, xMax, height, X } = g;
  const kinds = [...new Set(rows.flatMap((r) => r.sub.map((s) => s.kind)))];
  const statuses = [...new Set(rows.map((r) => r.status))];  // scoring is hatched in the status colour
  const defs = `<defs>${statuses.map((st, k) => hatch(`tl-hatch-${k}`, STATUS_COLORS[st] || "#444")).join("")}</defs>`;
  const paths = new Map();  // key -> [attributes, subpaths]
  const bar = (key, attrs, s, e, y, h) => {
    if (!paths.has(key)) paths.set(key, [attrs, []]);
    const x0 = X(s), bw = Math.max(0.5, X(e) - x0);
    paths.get(key)[1].push(`M${x0.toFixed(1)} ${y.toFixed(1)}h${bw.toFixed(1)}v${h.toFixed(1)}h${(-bw).toFixed(1)}z`);
  };
  const links = [];
  rows.forEach((r, i) => {
    const k = statuses.indexOf(r.status), y = top + i * rowH + rowH * 0.1, h = rowH * 0.8;
    bar("queued", `fill="${QUEUED_COLOR}"`, r.start, r.queued_end, y, h);
    r.gen.forEach(([s, e]) => bar(`gen s${k}`, `fill="${STATUS_COLORS[r.status] || "#444"}"`, s, e, y, h));
    if (r.score_start != null) bar(`score s${k}`, `fill="url(#tl-hatch-${k})"`, r.score_start, r.end, y, h);
    r.sub.forEach((s) => {
      const c = kinds.indexOf(s.kind);
      bar(`sub k${c}`, `fill="${SUB_COLORS[c % SUB_COLORS.length]}"`, s.start, s.end, top + i * rowH + rowH * (c % 2 ? 0.55 : 0.15), rowH * 0.3);
    });
    const j = r.retry_of == null ? -1 : r.retry_of - t.offset;
    if (j >= 0 && j < rows.length) links.push(`M${X(rows[j].end).toFixed(1)} ${top + (j + 0.5) * rowH}L${X(r.start).toFixed(1)} ${top + (i + 0.5) * rowH}`);
  });
  const every = Math.ceil(rows.length / MAX_ROW_LABELS);
  const labels = rows.map((r, i) => (i % every ? "" : `<text x="${left - 6}" y="${top + (i + 0.5) * rowH + 3}" text-anchor="end">${esc(rowLabel(r))}</text>`)).join("");
  const xt = ticks(0, xMax, 8).map((v) => `<line x1="${X(v)}" x2="${X(v)}" y1="${top - 4}" y2="${height}" stroke="#eceff3"/><text x="${X(v)}" y="${top - 8}" text-anchor="middle">${v}</text>`).join("");
  const bars = [...paths].map(([key, [attrs, d]]) => `<path class="${key}" ${attrs} d="${d.join("")}"/>`).join("");
  const retry = links.length ? `<path class="retry" stroke="#333" stroke-dasharray="2 2" fill="none" d="${links.join("")}"/>` : "";
  return { kinds, svg: `<svg ${SVG_NS} class="tl" width="${left + w + 20}" height="${height}" font-size="10">${defs}${xt}
    <text x="${left + w / 2}" y="12" text-anchor="middle" font-size="12">seconds since the step's first attempt_start</text>
    <g class="labels">${labels}</g><g class="bars">${bars}${retry}</g></svg>` };
}

function timelineHit(g, x, y) {
  // the row (and sub-span) under the point (x, y) of the chart, or null
  const i = Math.floor((y - g.top) / g.rowH);
  const r = g.rows[i];
  if (!r) return null;
  const v = ((x - g.left) / g.w) * g.xMax, frac = (y - g.top) / g.rowH - i;
  const sub = r.sub.find((s) => v >= s.start && v <= s.end && frac >= 0.15 && frac <= 0.85);
  if (sub) return subText(r, sub);
  return v >= r.start && v <= r.end ? hoverText(r) : null;
}

function timelineLegend(rows, kinds) {
  const swatch = (color, text, style = "") => `<span><i style="background:${color};${style}"></i>${esc(text)}</span>`;
  const statuses = [...new Set(rows.map((r) => r.status))];
  return swatch(QUEUED_COLOR, "queued (waiting for a slot)") +
    statuses.map((st) => swatch(STATUS_COLORS[st] || "#444", `generating · ${st}`)).join("") +
    swatch("repeating-linear-gradient(45deg,#555 0 2px,#fff 2px 4px)", "scoring (hatched)") +
    kinds.map((k, i) => swatch(SUB_COLORS[i % SUB_COLORS.length], `${k} (sub-span)`, "height:5px")).join("") +
    (rows.some((r) => r.retry_of != null) ? swatch("#333", "retry link (dotted)", "height:2px") : "");
}

function subText(r, s) {
  return `<b>${esc(s.name)}</b> ${(s.end - s.start).toFixed(3)} s${s.detail ? "<br>" + esc(JSON.stringify(s.detail)) : ""}<br>${rowLabel(r)}`;
}

async function renderTimeline() {
  if (!state.steps) await loadSteps();
  drawStepsChart();
  const step = state.step;
  if (step == null) { $("#timeline-count").textContent = "no lifecycle events yet"; return; }
  const t = await api(runPath(state.run, "timeline"), { step, limit: 2000 });
  if (step !== state.step) return;  // a newer selection superseded this one
  mark("timeline-data");
  const el = $("#timeline-chart");
  const g = timelineGeometry(t, el.clientWidth || 1200);
  const { kinds, svg } = timelineSvg(t, g);
  el.innerHTML = svg;
  const rows = t.rows;
  tooltip(el.querySelector("svg"), (_, x, y) => timelineHit(g, x, y));
  $("#timeline-legend").innerHTML = timelineLegend(rows, kinds);
  const counts = Object.entries(t.summary.status_counts).map(([k, v]) => `${v} ${k}`).join(", ");
  $("#timeline-count").textContent = `${t.total} attempts`;
  $("#timeline-count").dataset.attempts = String(t.total);
  $("#timeline-summary").textContent = t.total ? `step ${step}: ${counts}; mean queued ${t.summary.queue_s_mean.toFixed(3)} s, generating ${t.summary.gen_s_mean.toFixed(3)} s, scoring ${t.summary.score_s_mean.toFixed(3)} s; wall ${t.summary.wall_s.toFixed(2)} s` : "";
  $("#timeline-more").textContent = t.total > rows.length ? `showing attempts ${t.offset + 1}–${t.offset + rows.length} of ${t.total}` : "";
  document.body.dataset.timelineStep = String(step);
  mark("timeline-drawn");
}

const STEP_PARTS = [["queue_s_mean", "queued", "#9aa3ad"], ["gen_s_mean", "generating", "#2d6cdf"], ["score_s_mean", "scoring", "#b8860b"]];

function drawStepsChart() {
  // stacked mean queued / generating / scoring seconds per attempt, one bar per step
  const el = $("#steps-chart");
  const rows = state.steps ? state.steps.timeline_steps : [];
  const key = JSON.stringify([el.clientWidth, rows.map((r) => [r.step, ...STEP_PARTS.map(([k]) => r[k])])]);
  if (el.dataset.drawn === key) return;  // unchanged since the last poll
  el.dataset.drawn = key;
  const width = el.clientWidth || 1200, height = 240, left = 50, top = 10, bottom = 36, h = height - top - bottom;
  const total = (r) => STEP_PARTS.reduce((a, [k]) => a + (r[k] || 0), 0);
  const yMax = Math.max(1e-6, ...rows.map(total));
  const steps = rows.map((r) => r.step);
  const lo = Math.min(...steps, 1) - 0.5, hi = Math.max(...steps, 1) + 0.5;
  const X = (s) => left + ((s - lo) / (hi - lo)) * (width - left - 10);
  const bw = Math.min(48, Math.max(1, ((width - left - 10) / Math.max(1, hi - lo)) * 0.8));
  const Y = (v) => top + h - (v / yMax) * h;
  const bars = rows.map((r, i) => {
    let acc = 0;
    return STEP_PARTS.map(([k, , color]) => {
      const v = r[k] || 0, y0 = Y(acc + v), hh = Y(acc) - y0;
      acc += v;
      return `<rect data-i="${i}" x="${(X(r.step) - bw / 2).toFixed(1)}" y="${y0.toFixed(1)}" width="${bw.toFixed(1)}" height="${Math.max(0, hh).toFixed(1)}" fill="${color}"/>`;
    }).join("");
  }).join("");
  const yt = ticks(0, yMax, 5).map((v) => `<line x1="${left}" x2="${width - 10}" y1="${Y(v)}" y2="${Y(v)}" stroke="#eceff3"/><text x="${left - 4}" y="${Y(v) + 3}" text-anchor="end">${v}</text>`).join("");
  const xt = ticks(lo + 0.5, hi - 0.5, 10).filter(Number.isInteger).map((s) => `<text x="${X(s)}" y="${top + h + 14}" text-anchor="middle">${s}</text>`).join("");
  el.innerHTML = `<svg ${SVG_NS} width="${width}" height="${height}" font-size="10">${yt}${xt}<g class="bars">${bars}</g>
    <text x="${left + (width - left) / 2}" y="${height - 4}" text-anchor="middle" font-size="12">step (mean seconds per attempt)</text></svg>
    <div class="legend">${STEP_PARTS.map(([, name, color]) => `<span><i style="background:${color}"></i>${name}</span>`).join("")}</div>`;
  tooltip(el.querySelector("svg"), (target) => {
    const i = target.dataset ? target.dataset.i : undefined;
    if (i == null) return null;
    const r = rows[Number(i)];
    return r.summary_pending ? `step ${r.step}: summary still being computed` :
      `<b>step ${r.step}</b><br>` + STEP_PARTS.map(([k, name]) => `${name} ${(r[k] || 0).toFixed(3)} s`).join("<br>");
  });
}
