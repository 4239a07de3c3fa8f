// The elastic page: GET /api/elastic's answer (embedded, then fetched again) as tables, and
// the cluster timeline (frontend/elastic_figures.py). Both are fetched again a moment after
// a job changes on /ws/cluster/ (a start, a switch, an end, a setting) and every 30 s (the
// scheduler's intervals and back-offs run out with time).
import { changeText, gainText, holdText, pauseText, policyText, schedulerRangeText, stepText } from "./elastic-view.js";
import { relativeTime, localTime } from "./format.js";
import { draw } from "./plots.js";

const $ = (id) => document.getElementById(id);
const readJson = (id) => JSON.parse($(id).textContent);
let plan = readJson("elastic-plan");
let timeline = readJson("elastic-timeline-figure");

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

function jobCell(id, name) {
  const td = el("td");
  td.append(el("a", { href: `/jobs/${id}/` }, name));
  return td;
}

function row(attrs, first, texts) {
  const tr = el("tr", attrs);
  tr.append(first, ...texts.map((t) => el("td", {}, String(t))));
  return tr;
}

function drawStatus() {
  $("elastic-enabled").textContent = plan.enabled ? "scheduler on" : "scheduler off";
  $("elastic-enabled").dataset.state = plan.enabled ? "running" : "stopped";
  $("elastic-summary").textContent = `${plan.gpus} GPUs on ${plan.nodes.length} healthy node${plan.nodes.length === 1 ? "" : "s"}, ` +
    `${plan.free} free · sweeps every ${plan.settings.sweep_seconds} s`;
  $("elastic-problem").textContent = plan.problem || "";
  $("elastic-problem").hidden = !plan.problem;
}

function drawDecisions() {
  $("decisions-empty").hidden = plan.decisions.length > 0;
  $("decisions-table").hidden = plan.decisions.length === 0;
  $("decisions-body").replaceChildren(...plan.decisions.map((d) => row(
    { "data-job": d.job, "data-kind": d.kind }, jobCell(d.job_id, d.job),
    [changeText(d), d.layout, d.reason, gainText(d, plan.settings), pauseText(d), stepText(d)])));
  $("waiting-card").hidden = plan.waiting.length === 0;
  $("waiting-list").replaceChildren(...plan.waiting.map((w) => {
    const li = el("li", { "data-job": w.job });
    li.append(el("a", { href: `/jobs/${w.job_id}/` }, w.job), `: ${w.reason}`);
    return li;
  }));
}

function drawJobs() {
  $("elastic-jobs-empty").hidden = plan.jobs.length > 0;
  $("elastic-jobs-table").hidden = plan.jobs.length === 0;
  $("elastic-jobs-body").replaceChildren(...plan.jobs.map((j) => {
    const policy = el("td", { "data-field": "policy", "data-elastic": String(j.elastic) }, policyText(j.elastic));
    const tr = row({ "data-job": j.name }, jobCell(j.id, j.name), []);
    tr.append(el("td", {}, j.queued ? "queued" : j.state), policy,
      el("td", { "data-field": "range" }, schedulerRangeText(j)), el("td", { "data-field": "priority" }, String(j.priority)),
      el("td", {}, String(j.gpus)), el("td", {}, holdText(j) || "–"));
    return tr;
  }));
}

function drawSweep() {
  const sweep = plan.last_sweep;
  const when = $("sweep-when");
  when.replaceChildren();
  if (!sweep) {
    when.textContent = "No sweep has run yet.";
  } else {
    const time = el("time", { datetime: sweep.ran_at, "data-relative": "", title: localTime(sweep.ran_at) },
      relativeTime(sweep.ran_at));
    when.append("Ran ", time, sweep.outcomes.length ? "." : ": nothing to change.");
  }
  const outcomes = sweep ? sweep.outcomes : [];
  $("sweep-table").hidden = outcomes.length === 0;
  $("sweep-body").replaceChildren(...outcomes.map((o) => row({ "data-outcome": o.outcome }, jobCell(o.job_id, o.job),
    [changeText(o), o.outcome, o.detail || o.reason])));
}

function drawTimeline() {
  const node = $("elastic-timeline");
  draw(node, timeline);
  node.dataset.traces = String(timeline.data.length);
}

function drawAll() {
  drawStatus();
  drawDecisions();
  drawJobs();
  drawSweep();
  drawTimeline();
  document.body.dataset.elasticDrawn = String(Number(document.body.dataset.elasticDrawn || 0) + 1);
}

async function refresh() {
  const [answer, figure] = await Promise.all([
    fetch("/api/elastic", { credentials: "same-origin" }), fetch("/elastic/timeline.json", { credentials: "same-origin" })]);
  if (answer.ok) plan = await answer.json();
  if (figure.ok) timeline = await figure.json();
  drawAll();
}

let timer = null;
function refreshSoon(ms = 1500) {
  clearTimeout(timer);
  timer = setTimeout(refresh, ms);
}

function connect(retryMs = 500) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/ws/cluster/`);
  const badge = $("connection");
  socket.onopen = () => { badge.dataset.state = "live"; badge.textContent = "live"; retryMs = 500; };
  socket.onmessage = (message) => { if (JSON.parse(message.data).type === "job") refreshSoon(); };
  socket.onclose = (event) => {
    badge.dataset.state = event.code === 4401 ? "closed" : "reconnecting";
    badge.textContent = event.code === 4401 ? "signed out: reload to sign in" : "disconnected; retrying";
    if (event.code !== 4401) setTimeout(() => connect(Math.min(retryMs * 2, 10000)), retryMs);
  };
}

drawAll();
connect();
setInterval(refresh, 30_000);
window.dynaplane = { get plan() { return plan; }, refresh };
