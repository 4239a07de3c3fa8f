// Jobs list, live without reloading: state, layout, GPU count, elastic range and priority
// from the cluster stream (/ws/cluster/ `job` events), step and loss from each live job's own stream
// (/ws/jobs/<id>/ `metrics` events; a socket per live job, closed when the job ends).
// Sorted by a clicked column header, filtered by state and searched by name or model
// (jobs-view.js), in the address (?sort=&dir=&state=&q=) so that a link shares the view;
// every live change re-applies the view.
import { liveTimes, timeElement } from "./format.js";
import { arrange, clickSort, toQuery } from "./jobs-view.js";
import { elasticSortKey, policyText, rangeText } from "./elastic-view.js";

const readJson = (id) => JSON.parse(document.getElementById(id).textContent);
const LIVE_STATES = readJson("live-states");
const LIVE = new Set(LIVE_STATES);
const FIRST_DIR = readJson("jobs-sort-defaults");
let view = readJson("jobs-view");
const $ = (id) => document.getElementById(id);
const scheme = location.protocol === "https:" ? "wss" : "ws";
const jobSockets = new Map(); // job id -> WebSocket

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

const row = (id) => document.querySelector(`#jobs-body tr[data-id="${id}"]`);
const cell = (tr, field) => tr.querySelector(`[data-field="${field}"]`);

// A row's values as the view sorts and filters them (from the row's cells and data).
function rowData(tr) {
  const number = (text) => (text === undefined || text === "" || Number.isNaN(Number(text)) ? null : Number(text));
  return {
    id: Number(tr.dataset.id), name: tr.dataset.job, model: tr.dataset.model, layout: cell(tr, "layout").textContent,
    gpus: number(cell(tr, "gpus").textContent), state: cell(tr, "state").dataset.state,
    step: number(cell(tr, "step").dataset.step), loss: number(tr.dataset.loss),
    switches: number(cell(tr, "switches").textContent), elastic: elasticOf(tr),
    priority: number(cell(tr, "priority").textContent),
    created: Date.parse(tr.dataset.created),
  };
}

// The row's elastic settings, as its cell stores them (null before the stream told them).
function elasticOf(tr) {
  const box = cell(tr, "elastic");
  if (!box || box.dataset.elastic === undefined) return null;
  const bound = (text) => (text === "" ? null : Number(text));
  return elasticSortKey({ elastic: box.dataset.elastic === "true", min_gpus: bound(box.dataset.min),
    max_gpus: bound(box.dataset.max), world_size: Number(cell(tr, "gpus").textContent) });
}

function applyView() {
  const body = $("jobs-body");
  const rows = [...body.querySelectorAll("tr")];
  const byId = new Map(rows.map((tr) => [Number(tr.dataset.id), tr]));
  const shown = arrange(rows.map(rowData), view, LIVE_STATES).map((r) => byId.get(r.id));
  const visible = new Set(shown);
  for (const tr of rows) tr.hidden = !visible.has(tr);
  body.append(...shown, ...rows.filter((tr) => !visible.has(tr)));
  for (const th of document.querySelectorAll("#jobs-table th[data-sort]")) {
    th.setAttribute("aria-sort", th.dataset.sort !== view.sort ? "none" : view.dir === "asc" ? "ascending" : "descending");
  }
  const filtered = view.state || view.q;
  $("jobs-count").textContent = rows.length && filtered ? `${shown.length} of ${rows.length} jobs` : "";
  $("jobs-none-match").hidden = !(rows.length && !shown.length);
  $("jobs-table").dataset.shown = String(shown.length);
}

let viewTimer = null;
function applyViewSoon() {
  if (viewTimer === null) viewTimer = setTimeout(() => { viewTimer = null; applyView(); }, 50);
}

function setView(next) {
  view = next;
  history.replaceState(null, "", location.pathname + toQuery(view));
  applyView();
}

function newRow(job) {
  const tr = el("tr", { "data-job": job.name, "data-id": String(job.id), "data-model": job.model,
    "data-created": new Date().toISOString() });
  const created = el("td");
  created.append(timeElement(new Date().toISOString()));
  const name = el("td");
  name.append(el("a", { href: `/jobs/${job.id}/` }, job.name));
  const state = el("td");
  state.append(el("span", { class: "job-state", "data-field": "state" }));
  tr.append(name, el("td", {}, job.model), el("td", { "data-field": "layout" }), el("td", { "data-field": "gpus" }), state,
    el("td", { "data-field": "step" }, "–"), el("td", { "data-field": "loss" }, "–"),
    el("td", { "data-field": "switches" }, "0"), el("td", { "data-field": "elastic" }, "–"),
    el("td", { "data-field": "priority" }, "–"), created);
  $("jobs-body").prepend(tr);
  $("jobs-table").hidden = false;
  $("jobs-filter").hidden = false;
  $("jobs-empty").hidden = true;
  return tr;
}

// The elastic cell and the priority from the stream's job (the same words as the server's
// rows: frontend/elastic_text.py is rangeText's twin); a bound left empty follows the size.
function drawElastic(tr, job) {
  const box = cell(tr, "elastic");
  box.dataset.elastic = String(job.elastic);
  box.dataset.min = job.min_gpus == null ? "" : String(job.min_gpus);
  box.dataset.max = job.max_gpus == null ? "" : String(job.max_gpus);
  box.dataset.queued = String(job.queued);
  const parts = [el("span", { class: "policy", "data-field": "policy" }, policyText(job.elastic)),
    ` ${rangeText({ ...job, world_size: job.gpus })}`];
  if (job.queued && job.state === "pending") {
    parts.push(" ", el("span", { class: "queued", "data-field": "queued" }, "queued"));
  }
  box.replaceChildren(...parts);
  cell(tr, "priority").textContent = String(job.priority);
}

function upsertJob(job) {
  const tr = row(job.id) || newRow(job);
  cell(tr, "layout").textContent = job.layout;
  cell(tr, "gpus").textContent = String(job.gpus);
  drawElastic(tr, job);
  const state = cell(tr, "state");
  state.textContent = job.state;
  state.dataset.state = job.state;
  follow(job.id, job.state);
  applyViewSoon();
}

function follow(id, state) {
  if (LIVE.has(state) && !jobSockets.has(id)) {
    const socket = new WebSocket(`${scheme}://${location.host}/ws/jobs/${id}/`);
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      const tr = row(id);
      if (event.type !== "metrics" || !tr) return;
      const step = cell(tr, "step");
      if (Number(step.dataset.step || -1) >= event.step) return; // an older step: keep the newer one
      step.dataset.step = String(event.step);
      step.textContent = String(event.step);
      if (event.loss !== null) {
        cell(tr, "loss").textContent = event.loss.toFixed(4);
        tr.dataset.loss = String(event.loss);
      }
      if (view.sort === "step" || view.sort === "loss") applyViewSoon();
    };
    socket.onclose = () => { if (jobSockets.get(id) === socket) jobSockets.delete(id); };
    jobSockets.set(id, socket);
  } else if (!LIVE.has(state) && jobSockets.has(id)) {
    const socket = jobSockets.get(id);
    jobSockets.delete(id);
    socket.close();
  }
}

function setConnection(state, text) {
  $("connection").dataset.state = state;
  $("connection").textContent = text;
}

// After a gap or a reconnect, the cluster snapshot has every job's current row.
async function resync() {
  const response = await fetch("/api/cluster/snapshot", { credentials: "same-origin" });
  if (!response.ok) return;
  const snapshot = await response.json();
  seq = snapshot.seq;
  const ids = new Set(snapshot.jobs.map((job) => job.id));
  for (const tr of document.querySelectorAll("#jobs-body tr")) if (!ids.has(Number(tr.dataset.id))) tr.remove();
  for (const job of snapshot.jobs) upsertJob(job);
  applyViewSoon(); // (deleted while disconnected: gone)
}

let seq = null;
let retryMs = 500;
function connect() {
  const socket = new WebSocket(`${scheme}://${location.host}/ws/cluster/`);
  socket.onopen = () => { retryMs = 500; setConnection("live", "live"); resync(); };
  socket.onmessage = (message) => {
    const event = JSON.parse(message.data);
    if (event.type !== "job") {
      if (seq !== null && event.seq > seq + 1 && event.type !== "hello") resync();
      else if (event.type !== "hello") seq = event.seq;
      return;
    }
    if (seq !== null && event.seq <= seq) return; // already in the resync's snapshot
    if (seq !== null && event.seq > seq + 1) { resync(); return; }
    seq = event.seq;
    if (event.op === "remove") { row(event.job.id)?.remove(); applyViewSoon(); } else upsertJob(event.job);
  };
  socket.onclose = (event) => {
    if (event.code === 4401) { setConnection("closed", "signed out: reload to sign in"); return; }
    setConnection("reconnecting", `disconnected; retrying in ${Math.round(retryMs / 1000)} s`);
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  };
}

for (const tr of document.querySelectorAll("#jobs-body tr")) {
  follow(Number(tr.dataset.id), cell(tr, "state").dataset.state);
}
for (const button of document.querySelectorAll("#jobs-table button.sort")) {
  button.addEventListener("click", () => setView(clickSort(view, button.dataset.sort, FIRST_DIR)));
}
$("jobs-search").addEventListener("input", (event) => setView({ ...view, q: event.target.value.trim() }));
$("jobs-state").addEventListener("change", (event) => setView({ ...view, state: event.target.value }));
$("jobs-filter").addEventListener("submit", (event) => event.preventDefault());
$("jobs-clear").addEventListener("click", () => {
  $("jobs-search").value = "";
  $("jobs-state").value = "";
  setView({ ...view, state: "", q: "" });
});
applyView();
connect();
liveTimes();
