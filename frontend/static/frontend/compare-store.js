// The compare page's runs and how emulation events change them (mirrors
// controlplane/emulation/events.py: apply_emulation_event), and the page's query string.
// Pure: no DOM, no network.

export const TERMINAL = new Set(["done", "failed"]);

// Returns {snapshot, gap}: gap is true when events were missed and a fresh snapshot is needed.
export function applyEmulationEvent(snapshot, event) {
  if (event.type === "hello") return { snapshot, gap: event.seq > snapshot.seq };
  if (event.seq <= snapshot.seq) return { snapshot, gap: false };
  if (event.seq !== snapshot.seq + 1) return { snapshot, gap: true };
  if (event.type !== "emulation") return { snapshot: { ...snapshot, seq: event.seq }, gap: false };
  let runs = snapshot.runs;
  if (snapshot.ids.includes(event.run.id)) {
    const byId = new Map(runs.map((r) => [r.id, r]));
    byId.set(event.run.id, event.run);
    runs = snapshot.ids.filter((id) => byId.has(id)).map((id) => byId.get(id));
  }
  return { snapshot: { ...snapshot, seq: event.seq, runs }, gap: false };
}

// Follow `ids` from now on; runs already seen in events (`seen`, id -> run) fill in.
export function follow(snapshot, ids, runs, seen) {
  const byId = new Map(runs.map((r) => [r.id, r]));
  for (const id of ids) if (seen.has(id)) byId.set(id, seen.get(id));
  return { ...snapshot, ids, runs: ids.filter((id) => byId.has(id)).map((id) => byId.get(id)) };
}

// The query string that reopens a comparison (frontend/compare_views.py reads it).
export function comparisonQuery(settings, layouts, ids) {
  const params = new URLSearchParams();
  for (const key of ["model", "gpu", "gpus", "batch", "micro", "seq", "recompute"]) params.set(key, String(settings[key]));
  for (const layout of layouts) params.append("layout", layout);
  if (ids.length) params.set("runs", ids.join(","));
  return params.toString();
}

// One emulation request per layout, all with the same settings (POST /api/emulations).
export function emulationRequest(settings, layouts) {
  return {
    configs: layouts.map((layout) => ({
      model: settings.model, layout, gpus: settings.gpus, gpu_type: settings.gpu, global_batch: settings.batch,
      micro_batch: settings.micro, seq_len: settings.seq, recompute: settings.recompute,
    })),
  };
}

// DRF's 400 body ({"configs[0]": ["..."]} or {"configs": [{"gpus": ["..."]}]}) as lines.
export function errorLines(body, prefix = "") {
  if (typeof body === "string") return [prefix ? `${prefix}: ${body}` : body];
  if (Array.isArray(body)) {
    if (body.every((b) => typeof b === "string")) return body.map((b) => (prefix ? `${prefix}: ${b}` : b));
    return body.flatMap((b, i) => errorLines(b, `${prefix}[${i}]`));
  }
  if (body && typeof body === "object") {
    return Object.entries(body).flatMap(([k, v]) => errorLines(v, prefix ? `${prefix}.${k}` : k));
  }
  return [String(body)];
}

// The search's choice among finished runs (parallelism/emulator/search.py top_fitting): the `top`
// fastest (tokens/s) that fit in memory.
export function searchTop(runs, top) {
  return runs.filter((r) => r.state === "done" && r.result && r.result.memory && r.result.memory.fits)
    .sort((a, b) => b.result.tokens_per_second - a.result.tokens_per_second).slice(0, top);
}

// A search for the page's settings (POST /api/emulations/search): an agent ranks the layouts.
export function searchRequest(settings, top) {
  return { model: settings.model, gpus: settings.gpus, gpu_type: settings.gpu, global_batch: settings.batch,
    micro_batch: settings.micro, seq_len: settings.seq, recompute: settings.recompute, top };
}

// What a search run (kind "search", followed over /ws/emulations/) tells the page:
// {text, layouts (once done: the candidates to emulate), error (once failed)}.
export function searchStatus(run) {
  if (run.state === "failed") {
    const error = run.error || "failed without a reason";
    return { text: `Search failed: ${error}`, layouts: null, error };
  }
  if (run.state === "done") {
    const { layouts, candidates, top } = run.result;
    return { text: `Search: emulating ${layouts.length} of ${candidates} candidate layouts on the agents; ` +
      `the ${top} fastest that fit will stay…`, layouts: [...layouts], error: null };
  }
  const text = run.state === "queued" ? "Search: waiting for an agent to rank the candidate layouts…"
    : `Search: ${run.message || "ranking the candidate layouts"}…`;
  return { text, layouts: null, error: null };
}
