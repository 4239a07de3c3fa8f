// The cluster page's model at thousands of GPUs: built once from the page's snapshot (GPUs in
// the compact form of frontend/cluster_compact.py), then changed in place by each event (one
// GPU: O(1)), which says what changed so the page redraws only that. The seq rules are
// cluster-store.js's (seqVerdict), as on every page. Pure: no DOM, no network.
import { gpuKey, seqVerdict } from "./cluster-store.js";

export const byName = (a, b) => a.localeCompare(b, undefined, { numeric: true });

// The GpuView dicts of a compact snapshot (rows of positions into tables; job -1: none).
export function gpusFromCompact(compact) {
  const t = compact.tables;
  return compact.rows.map(([n, index, m, b, s, j]) => ({
    node: t.node[n], index, model_name: t.model[m], memory_bytes: t.memory[b], state: t.state[s],
    job: j < 0 ? null : t.job[j],
  }));
}

const bump = (counts, state, by) => { counts[state] = (counts[state] || 0) + by; };

export class ClusterModel {
  // snapshot: {seq, nodes: [NodeView], gpus: compact or [GpuView], jobs: [JobView]}
  constructor(snapshot) {
    this.seq = snapshot.seq;
    this.nodes = new Map(snapshot.nodes.map((n) => [n.name, n]));
    const gpus = Array.isArray(snapshot.gpus) ? snapshot.gpus : gpusFromCompact(snapshot.gpus);
    this.gpus = new Map(gpus.map((g) => [gpuKey(g), g]));
    this.jobs = new Map(snapshot.jobs.map((j) => [j.id, j]));
    this.count = { node: {}, gpu: {}, job: {} };
    for (const n of this.nodes.values()) bump(this.count.node, n.state, 1);
    for (const j of this.jobs.values()) bump(this.count.job, j.state, 1);
    this.jobGpus = new Map(); // job name -> Set of GPU keys it holds
    for (const g of this.gpus.values()) this._hold(g, 1);
    this.layout();
  }

  _hold(gpu, by) {
    bump(this.count.gpu, gpu.state, by);
    if (!gpu.job) return;
    if (!this.jobGpus.has(gpu.job)) this.jobGpus.set(gpu.job, new Set());
    const held = this.jobGpus.get(gpu.job);
    if (by > 0) held.add(gpuKey(gpu)); else held.delete(gpuKey(gpu));
    if (!held.size) this.jobGpus.delete(gpu.job);
  }

  // The drawing order: nodes by name (a GPU's node without a record yet included), each
  // node's GPUs by index. slots[i] is a GPU; slotNode[i]/slotPos[i] its node's ordinal and
  // its place among that node's GPUs; sizes[n] the GPUs of node n.
  layout() {
    const perNode = new Map([...this.nodes.keys()].map((name) => [name, []]));
    for (const g of this.gpus.values()) {
      if (!perNode.has(g.node)) perNode.set(g.node, []);
      perNode.get(g.node).push(g);
    }
    this.order = [...perNode.keys()].sort(byName);
    this.slots = []; this.slotNode = []; this.slotPos = []; this.sizes = []; this.firstSlot = new Map();
    this.slotOf = new Map(); this.nodeAt = new Map();
    this.order.forEach((name, n) => {
      this.nodeAt.set(name, n);
      const gpus = perNode.get(name).sort((a, b) => a.index - b.index);
      this.firstSlot.set(name, this.slots.length);
      this.sizes.push(gpus.length);
      gpus.forEach((g, pos) => {
        this.slotOf.set(gpuKey(g), this.slots.length);
        this.slots.push(g); this.slotNode.push(n); this.slotPos.push(pos);
      });
    });
  }

  nodeGpus(name) {
    const first = this.firstSlot.get(name);
    if (first === undefined) return [];
    return this.slots.slice(first, first + this.sizes[this.nodeAt.get(name)]);
  }

  // Apply one event. Returns {verdict: "apply" | "stale" | "gap", change}; change (applied
  // events only) names what to redraw: {relayout} (the drawing order changed: a new node or
  // GPU), {slot, key, was, now} (one GPU), {node, was, now}, {job, was, now} (was/now: the
  // records before and after; now null for a removed job).
  apply(event) {
    const verdict = seqVerdict(this.seq, event);
    if (verdict !== "apply") return { verdict, change: null };
    let change = null;
    if (event.type === "gpu") {
      const key = gpuKey(event.gpu);
      const was = this.gpus.get(key) || null;
      if (was) this._hold(was, -1);
      this.gpus.set(key, event.gpu);
      this._hold(event.gpu, 1);
      if (was && this.slotOf.has(key)) {
        const slot = this.slotOf.get(key);
        this.slots[slot] = event.gpu;
        change = { slot, key, was, now: event.gpu };
      } else {
        this.layout();
        change = { relayout: true, key, was, now: event.gpu };
      }
    } else if (event.type === "node") {
      const was = this.nodes.get(event.node.name) || null;
      if (was) bump(this.count.node, was.state, -1);
      bump(this.count.node, event.node.state, 1);
      this.nodes.set(event.node.name, event.node);
      if (!was) this.layout();
      change = { node: event.node.name, was, now: event.node, relayout: !was };
    } else if (event.type === "job") {
      const was = this.jobs.get(event.job.id) || null;
      if (was) bump(this.count.job, was.state, -1);
      const now = event.op === "upsert" ? event.job : null;
      if (now) { this.jobs.set(now.id, now); bump(this.count.job, now.state, 1); } else this.jobs.delete(event.job.id);
      change = { job: event.job.id, was, now };
    } else {
      return { verdict: "stale", change: null }; // an unknown type: not applied (cluster-store.js does the same)
    }
    this.seq = event.seq;
    return { verdict, change };
  }

  // The snapshot as plain data (what /api/cluster/snapshot holds), for scripts and tests.
  plain() {
    return { seq: this.seq, nodes: [...this.nodes.values()], gpus: [...this.gpus.values()],
      jobs: [...this.jobs.values()] };
  }
}

// The nodes that pass the filter {state, job, name} (empty: any), grouped by node state
// (every state but healthy first: what needs looking at), by name within a group.
export function filterNodes(model, filter) {
  const name = (filter.name || "").trim().toLowerCase();
  const held = filter.job ? model.jobGpus.get(filter.job) || new Set() : null;
  const jobNodes = held ? new Set([...held].map((key) => key.slice(0, key.lastIndexOf("/")))) : null;
  const groups = new Map();
  for (const node of model.order) {
    const record = model.nodes.get(node);
    const state = record ? record.state : "unknown";
    if (filter.state && state !== filter.state) continue;
    if (jobNodes && !jobNodes.has(node)) continue;
    if (name && !node.toLowerCase().includes(name)) continue;
    if (!groups.has(state)) groups.set(state, []);
    groups.get(state).push(node);
  }
  const rank = (state) => (state === "healthy" ? 1 : 0);
  return [...groups.entries()].sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b))
    .map(([state, nodes]) => ({ state, nodes }));
}
