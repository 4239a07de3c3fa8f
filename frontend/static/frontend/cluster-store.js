// The cluster snapshot and how events change it (mirrors controlplane/cluster/events.py:
// apply_event). Pure: no DOM, no network.

export const GPU_STATES = ["free", "allocated", "draining", "lost"];

export const gpuKey = (gpu) => `${gpu.node}/${gpu.index}`;

// Returns {snapshot, gap}: gap is true when events were missed and a fresh snapshot is needed.
export function applyEvent(snapshot, event) {
  if (event.type === "hello") {
    return { snapshot, gap: event.seq > snapshot.seq };
  }
  if (event.seq <= snapshot.seq) return { snapshot, gap: false };
  if (event.seq !== snapshot.seq + 1) return { snapshot, gap: true };
  const next = { ...snapshot, seq: event.seq };
  if (event.type === "node") {
    next.nodes = snapshot.nodes.filter((n) => n.name !== event.node.name).concat([event.node]);
  } else if (event.type === "gpu") {
    const key = gpuKey(event.gpu);
    next.gpus = snapshot.gpus.filter((g) => gpuKey(g) !== key).concat([event.gpu]);
  } else if (event.type === "job") {
    next.jobs = snapshot.jobs.filter((j) => j.id !== event.job.id);
    if (event.op === "upsert") next.jobs = next.jobs.concat([event.job]);
  } else {
    return { snapshot, gap: false };
  }
  return { snapshot: next, gap: false };
}

export function gpuStateCounts(nodeNames, gpus) {
  const position = new Map(nodeNames.map((name, i) => [name, i]));
  const counts = Object.fromEntries(GPU_STATES.map((s) => [s, nodeNames.map(() => 0)]));
  for (const gpu of gpus) {
    if (position.has(gpu.node)) counts[gpu.state][position.get(gpu.node)] += 1;
  }
  return counts;
}
