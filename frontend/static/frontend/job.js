// Job page: live charts (extended in place), the layout drawn on the GPUs, the layout
// history (bands + table), kept live over /ws/jobs/<id>/ and /ws/cluster/.
import { applyEvent } from "./cluster-store.js";
import { applyJobEvent, CHART_NAMES, dataProgress, historyBands, TERMINAL } from "./job-store.js";
import { ACTION_STATES, startJobActions } from "./job-actions.js";
import { startResizeFlow } from "./resize.js";
import { startElasticCard } from "./job-elastic.js";
import { startLogPanel } from "./log-view.js";
import { startExportCard } from "./job-export.js";
import { draw } from "./plots.js";
import { metricFigure } from "./metric-charts.js";
import { hostText, liveTimes } from "./format.js";
import { count, duration, sig } from "./format.js";

const readJson = (id) => JSON.parse(document.getElementById(id).textContent);
export const el = (tag, attrs = {}, text = "") => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
};

let job = readJson("job-data");
let live = readJson("job-live");
let cluster = readJson("cluster-snapshot");
const figures = readJson("job-figures");
const listeners = [];

function lastStep() {
  const loss = live.metrics.loss;
  return loss && loss.x.length ? loss.x[loss.x.length - 1] : 0;
}

// The chart options the page's controls set: smoothing (0: off) and the x axis.
const chartOptions = () => ({
  smoothing: Number(document.getElementById("smoothing").value),
  axis: document.querySelector("input[name=chart-axis]:checked")?.value || "step",
});

// Each chart is redrawn whole from the live snapshot (Plotly.react only touches what
// changed): the data, its bands and switch markers always in the same draw, so the layout
// band never lags the data. Events arriving together are drawn once.
function drawCharts() {
  const opts = chartOptions();
  for (const name of CHART_NAMES) {
    const node = document.getElementById(`chart-${name}`);
    const base = figures[name];
    const plotPx = Math.max(node.clientWidth - base.layout.margin.l - base.layout.margin.r, 100);
    const figure = metricFigure(base, name, live, job.layout, { ...opts, plotPx });
    draw(node, figure);
    node.dataset.points = String((live.metrics[name] || { x: [] }).x.length);
    if (name === "loss") node.dataset.validationPoints = String((live.metrics.validation_loss || { x: [] }).x.length);
    node.dataset.bands = String(figure.bands || 0);
    node.dataset.axis = opts.axis;
  }
}

let chartsTimer = null;
function drawChartsSoon() {
  if (chartsTimer === null) chartsTimer = setTimeout(() => { chartsTimer = null; drawCharts(); }, 16);
}

// GPUs clicked in the grid: free ones to add, this job's own to remove. Only their count
// is used (the new GPU count); the control plane picks the joining ranks' GPUs.
const picked = new Set();

function pickedCount() {
  const own = new Set(job.ranks.map((r) => `${r.node}/${r.gpu}`));
  let count = job.world_size;
  for (const key of picked) count += own.has(key) ? -1 : 1;
  return Math.max(count, 1);
}

let deleted = false;
let gridPickable = null;
const shownState = () => (deleted ? "deleted" : job.state);
const resizable = () => ACTION_STATES.preview.includes(shownState()); // GPUs can be picked for a new count

function togglePick(key) {
  if (!resizable()) return;
  if (picked.has(key)) picked.delete(key); else picked.add(key);
  document.getElementById("resize-gpus").value = String(pickedCount());
  drawGpus();
}

// A heterogeneous layout's modules, each with its own layout and ranks, above the grid.
function drawModules() {
  let legend = document.getElementById("job-modules");
  if (!legend) {
    legend = el("ul", { id: "job-modules", class: "module-legend", "aria-label": "Modules and their layouts" });
    document.getElementById("job-gpus").before(legend);
  }
  const modules = job.modules || [];
  legend.hidden = modules.length === 0;
  legend.replaceChildren(...modules.map((m) => el("li", { "data-module": m.module },
    `${m.module}: ${m.layout} on ranks ${m.ranks}${m.colocated ? " (colocated)" : ""}`)));
}

function drawGpus() {
  drawModules();
  const byGpu = new Map(job.ranks.map((r) => [`${r.node}/${r.gpu}`, r]));
  const canPick = resizable();
  gridPickable = canPick;
  const grid = document.getElementById("job-gpus");
  const nodes = [...cluster.nodes].sort((a, b) => a.name.localeCompare(b.name, undefined, { numeric: true }));
  grid.replaceChildren(...nodes.map((node) => {
    const row = el("div", { class: "node-row", role: "row", "data-node": node.name });
    const head = el("div", { class: `node-head node-${node.state}`, role: "rowheader" });
    head.append(el("strong", {}, node.name), el("span", { class: "node-state" }, node.state));
    row.append(head);
    const gpus = cluster.gpus.filter((g) => g.node === node.name).sort((a, b) => a.index - b.index);
    // The host's CPU and memory (heartbeats, live over the cluster stream) on the nodes this job runs on.
    const host = gpus.some((g) => g.job === job.name) ? hostText(node) : "";
    if (host) head.append(el("span", { class: "node-host", "data-field": "host-stats" }, host));
    row.dataset.jobNode = String(gpus.some((g) => g.job === job.name));
    for (const gpu of gpus) {
      // A rank is drawn only on a GPU the inventory says this job holds (a stopped job's
      // last placement is not drawn on GPUs that are free again, or another job's).
      const mine = gpu.job === job.name ? byGpu.get(`${gpu.node}/${gpu.index}`) : undefined;
      const other = gpu.job && gpu.job !== job.name;
      const state = mine ? "mine" : gpu.job === job.name ? "joining" : other ? "other" : gpu.state;
      const label = mine ? `${node.name} GPU ${gpu.index}: rank ${mine.rank}, ${mine.label}`
        : `${node.name} GPU ${gpu.index}: ${gpu.state}${gpu.job ? ` (job ${gpu.job})` : ""}`;
      const cell = el("div", { class: `gpu gpu-${gpu.state} job-gpu-${state}`, role: "cell", tabindex: "0",
        "data-gpu": `${gpu.node}/${gpu.index}`, "data-state": gpu.state, title: label, "aria-label": label });
      if (mine) {
        cell.dataset.rank = String(mine.rank);
        cell.dataset.role = mine.role;  // heterogeneous layouts: coloured by module (jobs.css)
      }
      const key = `${gpu.node}/${gpu.index}`;
      if (canPick && (mine || (gpu.state === "free" && !gpu.job))) {
        cell.classList.add("pickable");
        cell.setAttribute("role", "button");
        cell.setAttribute("aria-pressed", String(picked.has(key)));
        cell.setAttribute("aria-label", `${label}. ${mine ? "Remove from" : "Add to"} the new GPU count`);
        cell.addEventListener("click", () => togglePick(key));
        cell.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); togglePick(key); } });
      }
      const hetero = (job.modules || []).length > 0;
      const parts = mine && hetero
        ? mine.parts.map((p) => el("span", { class: "gpu-job gpu-part", "data-module": p.module }, `${p.module}: ${p.text}`))
        : [el("span", { class: "gpu-job" }, mine ? mine.label : gpu.job || gpu.state)];
      cell.append(el("span", { class: "gpu-index" }, mine ? `rank ${mine.rank}` : `GPU ${gpu.index}`), ...parts);
      row.append(cell);
    }
    return row;
  }));
}

function drawHistory() {
  const body = document.getElementById("history-body");
  const rows = [...live.transitions].reverse();
  document.getElementById("history-empty").hidden = rows.length > 0;
  body.replaceChildren(...rows.map((t) => {
    const tr = el("tr", { "data-transition": String(t.id), "data-state": t.state });
    const link = el("a", { href: `/transitions/${t.id}/` }, `#${t.id}`);
    const first = el("td");
    first.append(link);
    tr.append(first);
    for (const value of [`${t.source_layout} → ${t.destination_layout}`, t.state, t.step ?? "–",
      duration(t.pause_seconds), t.verified === null ? "–" : t.verified ? "verified" : "MISMATCH", t.reason]) {
      tr.append(el("td", {}, String(value)));
    }
    return tr;
  }));
}

function drawHeader() {
  const state = shownState();
  document.getElementById("job-state").textContent = state;
  document.getElementById("job-state").dataset.state = state;
  document.getElementById("job-layout").textContent = `${job.layout} on ${job.world_size} GPUs`;
  const step = Math.max(lastStep(), job.step || 0);
  document.getElementById("job-step").textContent = step ? `step ${step}` : "";
  document.getElementById("job-step").dataset.step = String(step);
  const data = dataProgress(step, job.global_batch, job.seq_len, job.samples_per_epoch);
  const progress = document.getElementById("job-data-progress");
  progress.textContent = step ? `${count(data.samples)} samples · ${count(data.tokens)} tokens` +
    (data.epoch === null ? "" : ` · epoch ${sig(data.epoch)}`) : "";
  Object.assign(progress.dataset, { samples: String(data.samples), tokens: String(data.tokens),
    epoch: data.epoch === null ? "" : String(data.epoch) });
  document.getElementById("job-error").textContent = job.error || "";
  document.getElementById("job-error").hidden = !job.error;
  document.body.dataset.jobSeq = String(live.seq);
  actions.update();
  resize.update();
  elasticCard.update();
  if (gridPickable !== null && gridPickable !== resizable()) drawGpus(); // GPUs are pickable only where resizing applies
}

async function refreshJob() {
  const response = await fetch(`/jobs/${job.id}/state.json`, { credentials: "same-origin" });
  if (response.status === 404) { deleted = true; actions.markDeleted(); drawHeader(); drawGpus(); return; }
  if (response.ok) {
    const next = await response.json();
    if (next.layout !== job.layout || !ACTION_STATES.resize.includes(next.state)) picked.clear();
    job = next;
    drawHeader(); drawGpus(); drawChartsSoon();
  }
}

async function reloadLive() {
  const response = await fetch(`/api/jobs/${job.id}/live`, { credentials: "same-origin" });
  if (response.ok) { live = await response.json(); drawCharts(); drawHistory(); drawHeader(); }
  reloadLog(); // a missed event may have been a `log` or an `export` one
  exportCard.reload();
}

async function reloadLog() {
  const response = await fetch(`/api/jobs/${job.id}/log`, { credentials: "same-origin" });
  if (response.ok) logPanel.replace(await response.json());
}

function onJobEvent(event) {
  const result = applyJobEvent(live, event);
  if (result.gap) { reloadLive(); return; }
  if (result.snapshot === live) return;
  const previous = live;
  live = result.snapshot;
  if (event.type === "log" && event.log.job === job.id) logPanel.replace(event.log);
  if (result.appended || event.type === "transition" || event.type === "rewind") drawChartsSoon();
  if (event.type === "transition") {
    drawHistory();
    const before = previous.transitions.find((t) => t.id === event.transition.id);
    if (TERMINAL.includes(event.transition.state) && (!before || before.state !== event.transition.state)) refreshJob();
  }
  drawHeader();
  for (const listener of listeners) listener(event, live);
}

function onClusterEvent(event) {
  const result = applyEvent(cluster, event);
  if (result.gap) { fetch("/api/cluster/snapshot", { credentials: "same-origin" }).then((r) => r.json()).then((s) => { cluster = s; drawGpus(); }); return; }
  if (result.snapshot === cluster) return;
  cluster = result.snapshot;
  if (event.type === "job" && event.job.id === job.id && event.op === "remove") {
    deleted = true; // deleted elsewhere (the API, another tab)
    actions.markDeleted();
    drawHeader(); drawGpus();
  } else if (event.type === "job" && event.job.id === job.id && (event.job.state !== job.state || event.job.layout !== job.layout)) {
    refreshJob();
  } else {
    drawGpus();
  }
}

function connect(path, onEvent, badge) {
  let retryMs = 500;
  const open = () => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${path}`);
    socket.onopen = () => { retryMs = 500; if (badge) { badge.dataset.state = "live"; badge.textContent = "live"; } };
    socket.onmessage = (message) => onEvent(JSON.parse(message.data));
    socket.onclose = (event) => {
      if (badge) {
        badge.dataset.state = event.code === 4401 ? "closed" : "reconnecting";
        badge.textContent = event.code === 4401 ? "signed out: reload to sign in" : "disconnected; retrying";
      }
      if (event.code !== 4401) { setTimeout(open, retryMs); retryMs = Math.min(retryMs * 2, 10000); }
    };
  };
  open();
}

const logPanel = startLogPanel(readJson("job-log-data"));
const exportCard = startExportCard({ getJob: () => job, exports: readJson("job-exports"),
  onEvent: (fn) => listeners.push(fn) });
const actions = startJobActions({ getJob: () => job, onChanged: () => refreshJob() });
const elasticCard = startElasticCard({ getJob: () => job, isDeleted: () => deleted, onChanged: (row) => {
  job = { ...job, elastic: row.elastic, min_gpus: row.min_gpus, max_gpus: row.max_gpus, priority: row.priority };
  drawHeader();
  refreshJob();
} });
const resize = startResizeFlow({ getJob: () => job, getLive: () => live, onEvent: (fn) => listeners.push(fn),
  getState: shownState, states: ACTION_STATES });
drawHeader();
drawGpus();
drawCharts();
drawHistory();
liveTimes();
document.getElementById("smoothing").addEventListener("input", (event) => {
  const value = Number(event.target.value);
  document.getElementById("smoothing-value").textContent = value > 0 ? value.toFixed(2) : "off";
  drawChartsSoon();
});
for (const radio of document.querySelectorAll("input[name=chart-axis]")) radio.addEventListener("change", drawChartsSoon);
window.addEventListener("resize", drawChartsSoon); // the label rows depend on the width
connect(`/ws/jobs/${job.id}/`, onJobEvent, document.getElementById("connection"));
connect("/ws/cluster/", onClusterEvent, null);
window.dynaplane = { get live() { return live; }, get job() { return job; } };
