// verst dashboard, the trajectory viewer (opened from the samples table): the prompt, then every
// segment of the response — model turns (tool calls included) and observations — with its
// boundaries, each token with its text; loss-masked tokens shaded; per token (hover) the id, the
// engine's and the trainer's log-prob, their mismatch, the advantage, the weight version and the
// MoE routing when recorded; tokens coloured by any of these; a chart of the per-token values.
"use strict";

const COLOR_MODES = {
  none: "no colour", logprob: "engine log-prob", mismatch: "|trainer − engine| log-prob",
  advantage: "advantage", version: "weight version", routing: "MoE routing (first layer)",
};
const PALETTE = ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#fee391", "#a6bddb"];

function tokenShow(text) {
  return esc(text ?? "").replace(/\n/g, '<span class="nl">⏎</span>\n').replace(/\t/g, "→\t");
}

function tokenValues(t) {
  const n = Math.max(0, t.tokens.length - t.prompt_length);  // response tokens recorded
  const at = (arr, i) => (arr && i < arr.length ? arr[i] : null);
  const out = [];
  for (let i = 0; i < n; i++) {
    const rl = at(t.rollout_logprobs, i), tl = at(t.trainer_logprobs, i);
    out.push({
      i, id: t.tokens[t.prompt_length + i], text: t.token_text ? t.token_text[t.prompt_length + i] : String(t.tokens[t.prompt_length + i]),
      // the mismatch only where the token is trained (observations carry no engine log-prob)
      mask: at(t.loss_mask, i), rollout: rl, trainer: tl, mismatch: rl != null && tl != null && at(t.loss_mask, i) !== 0 ? Math.abs(tl - rl) : null,
      advantage: at(t.advantages, i), version: at(t.token_versions, i),
      experts: t.routed_experts ? at(t.routed_experts.per_token, i) : null,
    });
  }
  return out;
}

function tokenColor(v, mode, scale) {
  if (v.mask === 0 || mode === "none") return "";
  if (mode === "logprob" && v.rollout != null) return `rgba(214,39,40,${Math.min(1, 1 - Math.exp(v.rollout)).toFixed(3)})`;
  if (mode === "mismatch" && v.mismatch != null) return `rgba(255,127,14,${Math.min(1, v.mismatch / Math.max(scale.mismatch, 1e-6)).toFixed(3)})`;
  if (mode === "advantage" && v.advantage != null) {
    const a = v.advantage / Math.max(scale.advantage, 1e-6);
    return a >= 0 ? `rgba(44,160,44,${Math.min(1, a).toFixed(3)})` : `rgba(214,39,40,${Math.min(1, -a).toFixed(3)})`;
  }
  if (mode === "version" && v.version != null) return PALETTE[((v.version % PALETTE.length) + PALETTE.length) % PALETTE.length];
  if (mode === "routing" && v.experts && v.experts[0] >= 0) return PALETTE[v.experts[0] % PALETTE.length];
  return "";
}

function tokenTitle(v) {
  const f = (x) => (x == null ? "–" : Number(x).toFixed(4));
  return `token ${v.i} · id ${v.id} · ${v.mask === 0 ? "loss-masked (not trained)" : "trained"}\n` +
    `engine log-prob ${f(v.rollout)} · trainer log-prob ${f(v.trainer)} · mismatch ${f(v.mismatch)}\n` +
    `advantage ${f(v.advantage)} · weight version ${v.version ?? "–"}` + (v.experts ? `\nexperts ${v.experts.join(" ")}` : "");
}

function segmentTitle(seg, t) {
  const range = `tokens ${seg.start}–${seg.start + seg.length - 1}`;
  if (seg.source === "env") return `observation (environment / tool response) · turn ${seg.turn} · ${seg.length} tokens (${range}) · loss mask 0`;
  const text = (t.token_text || []).slice(t.prompt_length + seg.start, t.prompt_length + seg.start + seg.length).join("");
  const tool = /<tool_call>|"name"\s*:/.test(text) ? " · tool call" : "";
  return `turn ${seg.turn} · model${tool} · weights v${seg.weight_version ?? "?"} · ${seg.length} tokens (${range})${seg.trainable ? "" : " · not trained"}`;
}

function renderTokens(values, mode, scale) {
  return values.map((v) => `<span class="tok${v.mask === 0 ? " masked" : ""}" data-i="${v.i}" data-id="${v.id}" data-mask="${v.mask}" style="${(c => c ? `background:${c}` : "")(tokenColor(v, mode, scale))}" title="${esc(tokenTitle(v))}">${tokenShow(v.text)}</span>`).join("");
}

function trajectoryHeader(t) {
  const reward = typeof t.reward === "object" && t.reward ? Object.entries(t.reward).map(([k, v]) => `${esc(k)}=${fmt(v)}`).join(", ") : fmt(t.reward);
  const env = t.env ? Object.entries(t.env).map(([k, v]) => `${esc(k)}: ${esc(JSON.stringify(v))}`).join(" · ") : "";
  return `<div class="traj-head"><b>step ${t.step} · ${esc(t.split)} · group ${t.group_index} · sample ${t.sample_index}</b>
    <span class="badge state-${t.status === "completed" ? "finished" : t.status === "failed" ? "failed" : "stopped_early"}">${esc(t.status)}</span>
    recorded: ${esc(t.reason)} · reward <b id="traj-reward">${reward}</b> · label <code>${esc(t.label == null ? "–" : typeof t.label === "string" ? t.label : JSON.stringify(t.label))}</code>
    · ${t.prompt_length} prompt + ${t.response_length} response tokens · weight versions ${esc((t.weight_versions || []).join(", "))}
    ${t.truncated_tokens ? `<span class="warn">· ${t.truncated_tokens} tokens not recorded (run.record.max_tokens)</span>` : ""}
    ${t.error ? `<div class="warn">error: ${esc(t.error)}</div>` : ""}${env ? `<div class="muted">${env}</div>` : ""}</div>`;
}

async function drawTrajectoryChart(el, t, values) {
  const x = values.map((v) => v.i);
  const traces = [
    { x, y: values.map((v) => (v.mask === 0 ? null : v.rollout)), name: "engine log-prob", mode: "lines+markers", marker: { size: 3 } },
    { x, y: values.map((v) => (v.mask === 0 ? null : v.trainer)), name: "trainer log-prob", mode: "lines+markers", marker: { size: 3, symbol: "x" }, line: { dash: "dash" } },
    { x, y: values.map((v) => v.mismatch), name: "|mismatch|", type: "bar", yaxis: "y2", marker: { color: "#ff7f0e" }, opacity: 0.5 },
    { x, y: values.map((v) => v.advantage), name: "advantage", mode: "lines", line: { dash: "dot", color: "#2ca02c" }, yaxis: "y2" },
  ].filter((tr) => tr.y.some((y) => y != null));
  const shapes = (t.segments || []).filter((s) => s.source === "env").map((s) => ({
    type: "rect", xref: "x", yref: "paper", x0: s.start - 0.5, x1: s.start + s.length - 0.5, y0: 0, y1: 1, fillcolor: "#999", opacity: 0.18, line: { width: 0 },
  })).concat((t.segments || []).slice(1).map((s) => ({ type: "line", xref: "x", yref: "paper", x0: s.start - 0.5, x1: s.start - 0.5, y0: 0, y1: 1, line: { color: "#555", dash: "dot", width: 1 } })));
  await (await plotly()).react(el, traces, {
    height: 240, margin: { l: 50, r: 50, t: 10, b: 35 }, hovermode: "x unified", shapes, legend: { orientation: "h", y: -0.3 },
    xaxis: { title: { text: "response token (grey: loss-masked observation, not plotted; dotted: segment boundary)" }, tickformat: "d" },
    yaxis: { title: { text: "log-prob" } }, yaxis2: { overlaying: "y", side: "right", title: { text: "mismatch / advantage" }, showgrid: false },
  }, { displaylogo: false, responsive: true });
}

function renderTrajectory(t) {
  const box = $("#trajectory-view");
  const values = tokenValues(t);
  const scale = {
    mismatch: Math.max(0, ...values.filter((v) => v.mask !== 0).map((v) => v.mismatch ?? 0)),
    advantage: Math.max(0, ...values.map((v) => Math.abs(v.advantage ?? 0))),
  };
  const mode = state.tokenColor || "none";
  const modes = Object.entries(COLOR_MODES).filter(([k]) => k !== "routing" || t.routed_experts);
  const promptIds = t.tokens.slice(0, t.prompt_length);
  const promptText = t.token_text ? t.token_text.slice(0, t.prompt_length) : promptIds.map(String);
  const segs = (t.segments || []).map((seg, k) => `<div class="seg seg-${esc(seg.source)}" data-seg="${k}" data-source="${esc(seg.source)}" data-start="${seg.start}" data-length="${seg.length}">
      <div class="seg-head">${esc(segmentTitle(seg, t))}</div><div class="toks">${renderTokens(values.slice(seg.start, seg.start + seg.length), mode, scale)}</div></div>`).join("");
  box.innerHTML = `${trajectoryHeader(t)}
    <div class="controls"><label>colour tokens by <select id="token-color">${modes.map(([k, v]) => `<option value="${k}" ${k === mode ? "selected" : ""}>${esc(v)}</option>`).join("")}</select></label>
      <span class="legend"><span><i class="masked-swatch"></i>loss-masked (not trained)</span></span>
      <button id="trajectory-close">close</button></div>
    <div class="seg seg-prompt"><div class="seg-head">prompt · ${t.prompt_length} tokens</div>
      <div class="toks">${promptIds.map((id, i) => `<span class="tok ptok" data-id="${id}" title="prompt token ${i} · id ${id}">${tokenShow(promptText[i])}</span>`).join("")}</div></div>
    ${segs || '<p class="muted">no response tokens</p>'}
    <div id="trajectory-chart"></div>`;
  box.hidden = false;
  $("#token-color").addEventListener("change", (e) => { state.tokenColor = e.target.value; renderTrajectory(t); });
  $("#trajectory-close").addEventListener("click", () => { box.hidden = true; box.innerHTML = ""; delete document.body.dataset.trajectory; });
  document.body.dataset.trajectory = `${t.step}/${t.split}/${t.sample_index}`;
  return drawTrajectoryChart($("#trajectory-chart"), t, values);  // the tokens are shown meanwhile
}

async function openTrajectory(step, split, sample) {
  const r = await api(runPath(state.run, "trajectory"), { step, split, sample });
  if (!r || !r.found) {
    $("#trajectory-view").hidden = false;
    $("#trajectory-view").innerHTML = `<p class="muted">no full trajectory recorded for sample ${sample} of step ${step} (run.record.trajectories_per_step chooses which are)</p>`;
    return;
  }
  const chart = renderTrajectory(r.trajectory);
  $("#trajectory-view").scrollIntoView({ block: "start" });
  await chart;
}
