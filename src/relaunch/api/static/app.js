// The relaunch dashboard: plain JavaScript over the REST API, refreshed every second.
"use strict";

const view = document.getElementById("view");
const errorBox = document.getElementById("error");
const tokenInput = document.getElementById("token");
tokenInput.value = localStorage.getItem("relaunch-token") || "";
tokenInput.addEventListener("change", () => localStorage.setItem("relaunch-token", tokenInput.value.trim()));

let timer = null;
let project = localStorage.getItem("relaunch-project") || "default";

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function showError(text) {
  errorBox.textContent = text;
  errorBox.hidden = !text;
}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  const token = tokenInput.value.trim();
  if (token) headers["Authorization"] = "Bearer " + token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const problems = (data.problems || []).map((p) => "  - " + p.message).join("\n");
    throw new Error(`${data.error_msg || response.statusText} (HTTP ${response.status})` + (problems ? "\n" + problems : ""));
  }
  return data;
}

const secs = (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(2));
const when = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "-");

function table(columns, rows, id) {
  return h("table", { id },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.length ? rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c))))
      : [h("tr", {}, h("td", { colspan: columns.length }, "none"))]));
}

function faultText(f) {
  let text = f.kind + (f.code ? " " + f.code : "");
  if (f.exit_code !== null && f.exit_code !== undefined) text += ` (exit ${f.exit_code})`;
  else if (f.signal) text += ` (signal ${f.signal})`;
  if (f.rank !== null && f.rank !== undefined) text += ` rank ${f.rank}`;
  return text;
}

// Goodput: where the job's wall time went, productive and lost by cause, as one stacked bar.
const CAUSE_COLOURS = { productive: "#2e8b57", detection: "#e67e22", recovery: "#c0392b",
  recomputed: "#8e44ad", unrecovered: "#555", slow: "#d4ac0d", startup: "#95a5a6" };
function goodputChart(g) {
  if (!g || !g.wall_s) return null;
  const parts = [["productive", g.productive_s], ...Object.entries(g.lost_s)].filter(([, s]) => s > 0);
  return h("div", { id: "goodput" },
    h("div", { class: "goodput-bar" }, parts.map(([cause, s]) => h("span", {
      class: "goodput-part", title: `${cause}: ${s.toFixed(1)} s`,
      style: `width:${(100 * s / g.wall_s).toFixed(2)}%;background:${CAUSE_COLOURS[cause] || "#999"}`,
    }))),
    h("div", { class: "goodput-legend" }, `ETTR ${(100 * g.ettr).toFixed(1)}% of ${g.wall_s.toFixed(1)} s · `,
      parts.map(([cause, s]) => h("span", { class: "goodput-key" },
        h("i", { style: `background:${CAUSE_COLOURS[cause] || "#999"}` }), `${cause} ${s.toFixed(1)} s`))));
}

// What broke and why, per recovery: the root cause's own error, the ranks that failed because of
// it, and on a hang every rank's stack with the culprit named.
function diagnosis(records) {
  const blocks = [];
  records.forEach((r, i) => {
    const f = r.fault, err = f.error, coll = r.collateral || [], hang = r.hang;
    const slow = f.kind === "slow";
    if (!err && !coll.length && !hang && !slow) return;
    const where = [f.rank !== null && f.rank !== undefined ? `rank ${f.rank}` : null,
      f.pod !== null && f.pod !== undefined ? `pod ${f.pod}` : null, f.node].filter(Boolean).join(", ");
    const parts = [h("h3", {}, `#${i + 1} root cause: ${faultText(f)}${where ? " (" + where + ")" : ""}`)];
    if (slow) parts.push(h("div", { class: "error-text" }, `slow: ${f.detail}`));
    if (err) {
      parts.push(h("div", { class: "error-text" }, err.type ? `${err.type}: ${err.message}` : `last output: ${err.message}`));
      if (err.traceback) parts.push(h("pre", { class: "traceback" }, err.traceback));
    }
    if (coll.length) parts.push(h("div", {}, `collateral (${coll.length}): ` +
      coll.map((c) => (c.rank !== null && c.rank !== undefined ? `rank ${c.rank}` : c.kind)).join(", ")));
    if (hang) {
      parts.push(h("div", { class: "error-text" }, hang.finding));
      for (const s of hang.stacks) {  // alike stacks once, with the ranks that share them
        const culprit = s.ranks.some((r) => hang.culprits.includes(r));
        parts.push(h("div", {}, `${ranksText(s.ranks)} (${s.state})${culprit ? " — culprit" : ""}`));
        parts.push(h("pre", { class: "traceback" }, s.stack || s.error || "no stack"));
      }
    }
    blocks.push(h("div", { class: "diagnosis", id: `diagnosis-${i + 1}` }, parts));
  });
  return blocks.length ? [h("h2", {}, "Root causes"), ...blocks] : [];
}

// "rank 3", "ranks 0, 2", or runs with a count: "ranks 0-1023, 1025-4095 (4,095)".
function ranksText(ranks) {
  if (ranks.length === 1) return `rank ${ranks[0]}`;
  const runs = [];
  for (const r of [...ranks].sort((a, b) => a - b)) {
    if (runs.length && r === runs[runs.length - 1][1] + 1) runs[runs.length - 1][1] = r;
    else runs.push([r, r]);
  }
  const parts = runs.map(([a, b]) => (b - a >= 2 ? `${a}-${b}` : Array.from({ length: b - a + 1 }, (_, i) => a + i).join(", ")));
  const count = ranks.length > 3 && parts.length < ranks.length ? ` (${ranks.length.toLocaleString("en")})` : "";
  return `ranks ${parts.join(", ")}${count}`;
}

// -- jobs list ------------------------------------------------------------------------------------

const EXAMPLE = {
  kind: "job",
  metadata: { name: "dashboard-demo", annotations: {
    "fault-tolerance/job-retry-num": "8", "fault-tolerance/job-unconditional-retry": "true",
    "fault-tolerance/hang-retry": "true", "fault-tolerance/pod-retry-num": "3" } },
  spec: { replicas: 2, command: "python examples/train_toy.py --steps 60 --step-seconds 0.05" },
  fault_plan: [{ kind: "process-exit", at_step: 20, pod: 1, exit_code: 1 }],
};

async function renderJobs() {
  const data = await api("GET", `/v2/${encodeURIComponent(project)}/training-jobs`);
  const rows = data.items.map((j) => [
    h("a", { href: `#/jobs/${encodeURIComponent(project)}/${j.metadata.id}` }, j.metadata.id),
    h("a", { href: `#/jobs/${encodeURIComponent(project)}/${j.metadata.id}` }, j.metadata.name),
    h("span", { class: "phase " + j.status.phase }, j.status.phase),
    j.status.attempt, j.status.last_step ?? "-", j.status.recoveries,
    new Date(j.metadata.create_time).toLocaleString(), j.status.reason,
  ]);
  return [
    h("h1", {}, "Training jobs"),
    h("div", { class: "row" }, h("label", { for: "project" }, "Project"),
      h("input", { id: "project", value: project, onchange: (e) => {
        project = e.target.value.trim() || "default";
        localStorage.setItem("relaunch-project", project);
        refresh();
      } })),
    table(["id", "name", "status", "attempt", "step", "recoveries", "created", "reason"], rows, "jobs"),
  ];
}

function submitForm() {
  const text = h("textarea", { id: "job-json", spellcheck: "false" }, JSON.stringify(EXAMPLE, null, 2));
  return [
    h("h2", {}, "Submit a job (ModelArts JSON; optional fault_plan)"),
    text,
    h("div", { class: "row" }, h("button", { class: "primary", id: "submit", onclick: async () => {
      try {
        const job = await api("POST", `/v2/${encodeURIComponent(project)}/training-jobs`, JSON.parse(text.value));
        showError("");
        location.hash = `#/jobs/${encodeURIComponent(project)}/${job.metadata.id}`;
      } catch (e) { showError(String(e.message || e)); }
    } }, "Submit")),
  ];
}

// -- one job ----------------------------------------------------------------------------------------

function chart(progress, records) {
  const W = 1000, H = 280, L = 56, R = 16, T = 16, B = 34;
  const samples = progress.samples;
  const times = samples.map((s) => s.at);
  for (const r of records) { times.push(r.fault_at); if (r.resumed_at) times.push(r.resumed_at); }
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("id", "progress-chart");
  const add = (tag, attrs, text) => {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    svg.append(el);
    return el;
  };
  if (!times.length) {
    add("text", { x: W / 2 - 120, y: H / 2 }, "no progress reported yet");
    return svg;
  }
  const t0 = Math.min(...times), t1 = Math.max(...times, t0 + 1);
  const s1 = Math.max(1, ...samples.map((s) => s.step));
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (s) => H - B - (s / s1) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const s = (s1 * i) / 4;
    add("line", { class: "grid", x1: L, x2: W - R, y1: y(s), y2: y(s) });
    add("text", { x: 6, y: y(s) + 4 }, Math.round(s));
  }
  add("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B });
  add("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B });
  for (let i = 0; i <= 5; i++) {
    const t = t0 + ((t1 - t0) * i) / 5;
    add("text", { x: x(t) - 14, y: H - 12 }, `${(t - t0).toFixed(0)} s`);
  }
  if (samples.length) {
    add("polyline", { class: "line", points: samples.map((s) => `${x(s.at)},${y(s.step)}`).join(" ") });
  }
  records.forEach((r, i) => {
    const fx = x(r.fault_at);
    add("line", { class: "fault", x1: fx, x2: fx, y1: T, y2: H - B });
    add("text", { class: "fault", x: fx + 3, y: T + 12 + (i % 4) * 13 }, `#${i + 1} ${r.fault.kind} → ${r.action}`);
    if (r.resumed_at) {
      const rx = x(r.resumed_at);
      add("line", { class: "resume", x1: rx, x2: rx, y1: T, y2: H - B });
      add("text", { class: "resume", x: rx + 3, y: H - B - 6 - (i % 4) * 13 }, `MTTR ${secs(r.mttr_s)} s`);
    }
  });
  return svg;
}

async function renderJob(proj, id) {
  const base = `/v2/${encodeURIComponent(proj)}/training-jobs/${encodeURIComponent(id)}`;
  const [job, progress] = await Promise.all([api("GET", base), api("GET", base + "/progress")]);
  const rec = job.recovery;
  const records = rec.records;
  const budget = rec.budgets_left || {};
  const card = (k, v, vid) => h("div", { class: "card" }, h("div", { class: "k" }, k), h("div", { class: "v", id: vid }, v));
  const recordRows = records.map((r, i) => [
    i + 1, faultText(r.fault), r.fault.node || (r.fault.pod !== null ? `pod ${r.fault.pod}` : "-"),
    r.fault.chip ?? "-", r.fault.code || "-", r.action, (r.isolated_nodes || []).join(", ") || "-",
    `job ${r.budgets_left.job ?? "-"} · pod ${r.budgets_left.pod ?? "-"} · retry ${r.budgets_left.fault_retry ?? "-"}`,
    secs(r.detect_s), h("span", { class: "mttr" }, secs(r.mttr_s)),
    h("span", { class: "outcome " + r.outcome }, r.outcome),
  ]);
  const podRows = rec.pods.map((p) => [p.name, p.node, p.generation, p.schedule_count, p.proc_start_count]);
  const ended = ["Succeeded", "Failed", "Stopped"].includes(job.status.phase);
  return [
    h("h1", {}, `${job.metadata.name} `, h("span", { class: "phase " + job.status.phase, id: "job-phase" }, job.status.phase)),
    h("div", { class: "sub" }, `id ${job.metadata.id} · project ${job.metadata.project_id} · ${job.status.reason || ""}`),
    h("div", { class: "cards" },
      card("step", job.status.last_step ?? "-", "job-step"),
      card("attempt", job.status.attempt),
      card("job restarts used", rec.restarts_used),
      card("pod reschedules used", rec.pod_restarts_used),
      card("budget left (job / pod / retry)", `${budget.job ?? "-"} / ${budget.pod ?? "-"} / ${budget.fault_retry ?? "-"}`),
      card("isolated nodes", rec.isolated_nodes.join(", ") || "none"),
      card("recoveries", records.length, "job-recoveries")),
    h("h2", {}, "Training progress, with faults (red) and resumed progress (green)"),
    h("div", { class: "chart" }, chart(progress, records)),
    h("h2", {}, "Goodput: where the time went"),
    goodputChart(rec.goodput),
    h("h2", {}, "Fault recovery details"),
    table(["#", "fault", "node", "chip", "code", "action", "isolated", "budget left", "detect s", "MTTR s", "outcome"], recordRows, "records"),
    ...diagnosis(records),
    h("h2", {}, "Pods and counters"),
    table(["pod", "node", "generation", "MA_SCHEDULE_CNT", "MA_PROC_START_CNT"], podRows, "pods"),
    h("h2", {}, "Events"),
    h("div", { class: "events" }, progress.events.slice(-200).map((e) => `${when(e.at)}  ${e.text}\n`)),
    ended ? null : h("div", { class: "row" },
      h("button", { class: "danger", id: "stop", onclick: async () => {
        try { await api("POST", base + "/actions", { action_type: "terminate" }); showError(""); refresh(); }
        catch (e) { showError(String(e.message || e)); }
      } }, "Stop job")),
  ];
}

// -- nodes ------------------------------------------------------------------------------------------

async function renderNodes() {
  const data = await api("GET", "/v2/nodes");
  const act = (name, verb) => async () => {
    try { await api("POST", `/v2/nodes/${encodeURIComponent(name)}/${verb}`); showError(""); refresh(); }
    catch (e) { showError(String(e.message || e)); }
  };
  const rows = data.items.map((n) => [
    n.name, h("span", { class: "state " + n.state }, n.state),
    Array.from({ length: n.chips }, (_, c) => {
      const bad = n.faulty_chips.find((f) => f.chip === c);
      return bad ? `chip ${c}: ${bad.kind} ${bad.code}` : `chip ${c}: ok`;
    }).join(" · "),
    n.reason, when(n.last_heartbeat),
    n.state === "Isolated"
      ? h("button", { onclick: act(n.name, "release"), id: `release-${n.name}` }, "Release")
      : h("button", { onclick: act(n.name, "cordon"), id: `cordon-${n.name}` }, "Cordon"),
  ]);
  return [h("h1", {}, "Nodes"), table(["node", "state", "chip health", "reason", "last heartbeat", ""], rows, "nodes")];
}

// -- routing --------------------------------------------------------------------------------------

let submitBlock = null;

async function refresh() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  document.getElementById("nav-jobs").classList.toggle("on", parts[0] !== "nodes");
  document.getElementById("nav-nodes").classList.toggle("on", parts[0] === "nodes");
  try {
    let content;
    if (parts[0] === "jobs" && parts.length >= 3) content = await renderJob(parts[1], parts[2]);
    else if (parts[0] === "nodes") content = await renderNodes();
    else {
      content = await renderJobs();
      // keep what the user is typing: the form is built once per visit of the list
      submitBlock = submitBlock || h("section", {}, submitForm());
      content.push(submitBlock);
    }
    view.replaceChildren(...content.filter((c) => c !== null && c !== undefined));
    if (errorBox.dataset.source === "load") showError("");
  } catch (e) {
    errorBox.dataset.source = "load";
    showError(String(e.message || e));
  }
}

window.addEventListener("hashchange", () => { submitBlock = null; refresh(); });
refresh();
timer = setInterval(refresh, 1000);
