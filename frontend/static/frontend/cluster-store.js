// The cluster snapshot and how events change it (mirrors controlplane/cluster/events.py:
// apply_event). Pure: no DOM, no network.

export const GPU_STATES = ["free", "allocated", "draining", "lost"];

export const gpuKey = (gpu) => `${gpu.node}/${gpu.index}`;

// What to do with an event at a snapshot taken at `seq`: "gap" (events were missed: a fresh
// snapshot is needed), "stale" (already in it) or "apply" (the next one).
export function seqVerdict(seq, event) {
  if (event.type === "hello") return event.seq > seq ? "gap" : "stale";
  if (event.seq <= seq) return "stale";
  return event.seq === seq + 1 ? "apply" : "gap";
}

// Returns {snapshot, gap}: gap is true when events were missed and a fresh snapshot is needed.
export function applyEvent(snapshot, event) {
  const verdict = seqVerdict(snapshot.seq, event);
  if (verdict !== "apply") return { snapshot, gap: verdict === "gap" };
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
