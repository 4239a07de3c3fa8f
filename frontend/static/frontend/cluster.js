// Cluster page: render the embedded snapshot, then keep it live over /ws/cluster/.
import { applyEvent, gpuStateCounts, GPU_STATES } from "./cluster-store.js";
import { draw } from "./plots.js";
import { bytes, hostText } from "./format.js";

const readJson = (id) => JSON.parse(document.getElementById(id).textContent);

let snapshot = readJson("cluster-snapshot");
const figure = readJson("gpu-figure");
const byName = (a, b) => a.name.localeCompare(b.name, undefined, { numeric: true });

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function renderGrid() {
  const grid = document.getElementById("cluster-grid");
  const nodes = [...snapshot.nodes].sort(byName);
  document.getElementById("cluster-empty").hidden = nodes.length > 0;
  grid.replaceChildren(
    ...nodes.map((node) => {
      const row = el("div", { class: "node-row", role: "row", "data-node": node.name, "data-state": node.state });
      const head = el("div", { class: `node-head node-${node.state}`, role: "rowheader",
        title: `${node.host} · ${node.device} · ${node.gpu_count} GPUs, ${bytes(node.gpu_memory_bytes)}` });
      head.append(el("strong", {}, node.name), el("span", { class: "node-state" }, node.state));
      const host = hostText(node);
      if (host) head.append(el("span", { class: "node-host", "data-field": "host-stats" }, host));
      row.append(head);
      const gpus = snapshot.gpus.filter((g) => g.node === node.name).sort((a, b) => a.index - b.index);
      for (const gpu of gpus) {
        const label = `${node.name} GPU ${gpu.index}: ${gpu.state}${gpu.job ? ` (job ${gpu.job})` : ""}, ` +
          `${gpu.model_name}, ${bytes(gpu.memory_bytes)}`;
        const cell = el("div", { class: `gpu gpu-${gpu.state}`, role: "cell", tabindex: "0",
          "data-gpu": `${gpu.node}/${gpu.index}`, "data-state": gpu.state, title: label, "aria-label": label });
        cell.append(el("span", { class: "gpu-index" }, String(gpu.index)), el("span", { class: "gpu-job" }, gpu.job || ""));
        row.append(cell);
      }
      return row;
    }),
  );
}

function renderJobs() {
  const body = document.getElementById("jobs-body");
  const jobs = [...snapshot.jobs].sort(byName);
  document.getElementById("jobs-empty").hidden = jobs.length > 0;
  body.replaceChildren(...jobs.map((job) => {
    const tr = el("tr", { "data-job": job.name });
    const name = el("td");
    name.append(el("a", { href: `/jobs/${job.id}/` }, job.name));
    tr.append(name);
    for (const value of [job.model, job.layout, String(job.gpus), job.state]) tr.append(el("td", {}, value));
    return tr;
  }));
}

function renderSummary() {
  const counts = Object.fromEntries(GPU_STATES.map((s) => [s, snapshot.gpus.filter((g) => g.state === s).length]));
  const healthy = snapshot.nodes.filter((n) => n.state === "healthy").length;
  document.getElementById("summary").textContent =
    `${healthy}/${snapshot.nodes.length} nodes healthy · ${snapshot.gpus.length} GPUs: ` +
    GPU_STATES.map((s) => `${counts[s]} ${s}`).join(", ");
}

function renderChart() {
  if (!window.Plotly) return;
  const names = [...snapshot.nodes].sort(byName).map((n) => n.name);
  const counts = gpuStateCounts(names, snapshot.gpus);
  figure.data.forEach((trace) => { trace.x = names; trace.y = counts[trace.name]; });
  draw("gpu-state-chart", figure);
}

function render() {
  renderGrid();
  renderJobs();
  renderSummary();
  renderChart();
  document.body.dataset.seq = String(snapshot.seq);
}

async function reloadSnapshot() {
  const response = await fetch("/api/cluster/snapshot", { credentials: "same-origin" });
  if (response.ok) {
    snapshot = await response.json();
    render();
  }
}

function setConnection(state, text) {
  const badge = document.getElementById("connection");
  badge.dataset.state = state;
  badge.textContent = text;
}

let retryMs = 500;
function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/ws/cluster/`);
  socket.onopen = () => { retryMs = 500; setConnection("live", "live"); };
  socket.onmessage = (message) => {
    const result = applyEvent(snapshot, JSON.parse(message.data));
    if (result.gap) { reloadSnapshot(); return; }
    if (result.snapshot !== snapshot) { snapshot = result.snapshot; render(); }
  };
  socket.onclose = (event) => {
    if (event.code === 4401) { setConnection("closed", "signed out: reload to sign in"); return; }
    setConnection("reconnecting", `disconnected; retrying in ${Math.round(retryMs / 1000)} s`);
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  };
}

render();
connect();
window.dynaplane = { get snapshot() { return snapshot; } };
