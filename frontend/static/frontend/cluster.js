// Cluster page: render the embedded snapshot, then keep it live over /ws/cluster/. Events
// change the model at once and mark what they touched; one animation frame (at most ten a
// second) redraws only that (cells, chips, rows, counters), however many events came since.
import { GPU_STATES } from "./cluster-store.js";
import { ClusterModel } from "./cluster-model.js";
import { GpuMap } from "./gpu-map.js";
import { gpuLabel, NodeList } from "./cluster-nodes.js";
import { JobsTable } from "./cluster-jobs.js";
import { integer as count } from "./format.js";
import { filterFromQuery, filterToQuery } from "./cluster-filter.js";

const $ = (id) => document.getElementById(id);
const readJson = (id) => JSON.parse($(id).textContent);

const STATES = readJson("cluster-states");
let model = new ClusterModel(readJson("cluster-snapshot"));
const style = getComputedStyle(document.documentElement);
const colors = Object.fromEntries(GPU_STATES.map((s) => [s, style.getPropertyValue(`--${s}`).trim() || "#888"]));
const map = new GpuMap($("gpu-map"), colors);
const nodes = new NodeList($("cluster-grid"), $("nodes-count"), $("nodes-more"));
const jobs = new JobsTable($("jobs-body"), $("jobs-empty"), $("filter-job"));
// What the node list shows and the map outlines, from the address (a shared link) and kept in it.
const filter = filterFromQuery(location.search, STATES.node, new Set([...model.jobs.values()].map((j) => j.name)));
function keepInAddress() {
  const query = filterToQuery(filter);
  if (query !== location.search) history.replaceState(null, "", location.pathname + query);
}

// What the next frame redraws.
const dirty = { all: true, slots: new Set(), nodes: new Set(), list: false, jobs: new Set(), jobList: false,
  summary: true };
// At most one redraw every FRAME_MS: a burst of events costs one paint, not one each.
const FRAME_MS = 100;
let frame = 0, timer = 0, lastFlush = -Infinity;
function schedule() {
  if (frame || timer) return;
  const wait = lastFlush + FRAME_MS - performance.now();
  if (wait <= 0) frame = requestAnimationFrame(flush);
  else timer = setTimeout(() => { timer = 0; frame = requestAnimationFrame(flush); }, wait);
}

function flush() {
  frame = 0;
  lastFlush = performance.now();
  const wrap = $("gpu-map-wrap");
  if (dirty.all) {
    map.relayout(model, wrap.clientWidth);
    jobs.render(model);
    dirty.list = true;
  } else if (dirty.slots.size) {
    map.draw(dirty.slots);
  }
  if (dirty.list) nodes.render(model, filter, filter.job);
  else {
    for (const name of dirty.nodes) nodes.updateNode(model, name, filter.job);
    for (const slot of dirty.slots) nodes.updateGpu(model.slots[slot], filter.job);
  }
  if (!dirty.all) {
    if (dirty.jobList) jobs.render(model);
    else for (const change of dirty.jobs) if (!jobs.update(change)) { jobs.render(model); break; }
  }
  if (dirty.summary || dirty.all) renderSummary();
  if ($("cluster-empty").hidden !== model.order.length > 0) $("cluster-empty").hidden = model.order.length > 0;
  document.body.dataset.seq = String(model.seq);
  Object.assign(dirty, { all: false, list: false, jobList: false, summary: false });
  dirty.slots.clear(); dirty.jobs.clear(); dirty.nodes.clear();
  if (!document.body.dataset.ready) {
    document.body.dataset.ready = "true";
    performance.mark("cluster-ready"); // first useful paint: summary, map and list drawn
  }
}

const counters = new Map([...document.querySelectorAll("[data-count]")].map((n) => [n.dataset.count, n]));
function renderSummary() {
  const c = model.count;
  const set = (name, n) => {
    const node = counters.get(name);
    if (node && node.textContent !== count(n)) node.textContent = count(n);
  };
  set("node-total", model.nodes.size); set("gpu-total", model.gpus.size); set("job-total", model.jobs.size);
  for (const s of STATES.node) set(`node-${s}`, c.node[s] || 0);
  for (const s of STATES.gpu) set(`gpu-${s}`, c.gpu[s] || 0);
  for (const s of STATES.job) {
    set(`job-${s}`, c.job[s] || 0);
    const item = counters.get(`job-${s}`).parentElement;
    if (item.hidden !== !c.job[s]) item.hidden = !c.job[s];
  }
  const line = `${c.node.healthy || 0}/${model.nodes.size} nodes healthy · ${model.gpus.size} GPUs: ` +
    GPU_STATES.map((s) => `${c.gpu[s] || 0} ${s}`).join(", ");
  if ($("summary").textContent !== line) $("summary").textContent = line;
}

function touched(change) {
  dirty.summary = true;
  if (change.relayout) { dirty.all = true; return; }
  if (change.slot !== undefined) {
    dirty.slots.add(change.slot);
    const job = filter.job;
    // (a node may join or leave the job filter)
    if (job && (change.was.job === job || change.now.job === job)) dirty.list = true;
  } else if (change.node !== undefined) {
    if (change.was && change.was.state === change.now.state) dirty.nodes.add(change.node);
    else dirty.list = true; // it moves to another group
  } else if (change.job !== undefined) {
    if (change.was && change.now && change.was.name === change.now.name) dirty.jobs.add(change);
    else dirty.jobList = true;
  }
}

// Events: applied to the model as they come; a gap reloads the snapshot once (events that
// arrive meanwhile wait, then go through the same rules on the fresh snapshot).
let waiting = null;
function handle(event) {
  if (waiting) { waiting.push(event); return; }
  const { verdict, change } = model.apply(event);
  if (verdict === "gap") { waiting = [event]; reloadSnapshot(); return; }
  if (change) { touched(change); schedule(); }
}

async function reloadSnapshot() {
  let fresh = null;
  try {
    const response = await fetch("/cluster/snapshot.json", { credentials: "same-origin" });
    if (response.ok && (response.headers.get("content-type") || "").includes("json")) fresh = await response.json();
  } catch { /* retried below */ }
  if (!fresh) { setTimeout(reloadSnapshot, 1000); return; }
  model = new ClusterModel(fresh);
  const pending = waiting;
  waiting = null;
  dirty.all = true; dirty.summary = true;
  schedule();
  for (const event of pending) handle(event);
}

function setConnection(state, text) {
  const badge = $("connection");
  badge.dataset.state = state;
  badge.textContent = text;
}

let retryMs = 500;
function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/ws/cluster/`);
  socket.onopen = () => { retryMs = 500; setConnection("live", "live"); };
  socket.onmessage = (message) => handle(JSON.parse(message.data));
  socket.onclose = (event) => {
    if (event.code === 4401) { setConnection("closed", "signed out: reload to sign in"); return; }
    setConnection("reconnecting", `disconnected; retrying in ${Math.round(retryMs / 1000)} s`);
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  };
}

// Selecting a job (the Job filter, its GPU count in the jobs table, or a GPU of it on the
// map) lists its nodes and outlines its GPUs.
function selectJob(name) {
  filter.job = name || "";
  $("filter-job").value = filter.job;
  map.highlight(filter.job);
  keepInAddress();
  dirty.list = true;
  schedule();
}

function showTip(slot, x, y) {
  const tip = $("gpu-tip");
  if (slot === null) { tip.hidden = true; return; }
  tip.textContent = gpuLabel(model.slots[slot]);
  tip.dataset.gpu = `${model.slots[slot].node}/${model.slots[slot].index}`;
  tip.hidden = false;
  const wrap = $("gpu-map-wrap");
  tip.style.left = `${Math.max(0, Math.min(x + 12, wrap.clientWidth - tip.offsetWidth))}px`;
  tip.style.top = `${y + 14}px`;
}

function mapPoint(event) {
  const box = $("gpu-map").getBoundingClientRect();
  const x = event.clientX - box.left, y = event.clientY - box.top;
  const wrap = $("gpu-map-wrap");
  return { slot: map.slotAt(x, y), x: x + wrap.scrollLeft, y: y + wrap.scrollTop + $("gpu-map").offsetTop };
}

const canvas = $("gpu-map");
canvas.addEventListener("pointermove", (event) => { const p = mapPoint(event); showTip(p.slot, p.x, p.y); });
canvas.addEventListener("pointerleave", (event) => { if (event.pointerType === "mouse") showTip(null); });
canvas.addEventListener("click", (event) => {
  const p = mapPoint(event);
  showTip(p.slot, p.x, p.y);
  if (p.slot !== null) {
    const job = model.slots[p.slot].job;
    if (job) selectJob(filter.job === job ? "" : job);
  }
});
const refilter = (field) => (event) => {
  filter[field] = event.target.value;
  keepInAddress();
  dirty.list = true;
  schedule();
};
$("filter-state").addEventListener("change", refilter("state"));
$("filter-job").addEventListener("change", (event) => selectJob(event.target.value));
$("filter-name").addEventListener("input", refilter("name"));
$("jobs-body").addEventListener("click", (event) => {
  const button = event.target.closest("[data-select-job]");
  if (button) selectJob(filter.job === button.dataset.selectJob ? "" : button.dataset.selectJob);
});
nodes.onMore = () => { dirty.list = true; schedule(); };
let lastWidth = 0;
new ResizeObserver(() => {
  const width = $("gpu-map-wrap").clientWidth;
  if (width !== lastWidth && lastWidth) { dirty.all = true; schedule(); }
  lastWidth = width;
}).observe($("gpu-map-wrap"));

flush();
$("filter-state").value = filter.state;
$("filter-name").value = filter.name;
selectJob(filter.job);  // (the picker has its options from the first flush)
connect();
window.dynaplane = {
  get snapshot() { return model.plain(); },
  get model() { return model; },
  selectJob,
  // The GPU keys the map outlines now (the selected job's), sorted.
  highlighted: () => (filter.job ? [...(model.jobGpus.get(filter.job) || [])].sort() : []),
  // What the map draws for one GPU: {state, job, highlighted}.
  cell: (key) => {
    const slot = model.slotOf.get(key);
    if (slot === undefined) return null;
    const gpu = model.slots[slot];
    return { state: gpu.state, job: gpu.job, highlighted: Boolean(map.job) && gpu.job === map.job };
  },
  // Where the map draws one GPU (client px): {x, y, width, height}.
  cellBox: (key) => (model.slotOf.has(key) ? map.box(model.slotOf.get(key)) : null),
};
