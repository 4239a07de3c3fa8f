// One job's live snapshot and how its events change it (mirrors controlplane/jobs/events.py:
// apply_job_event), plus the layout-history bands (mirrors frontend/figures.py:
// history_bands) and the step time around a switch (figures.step_time_around).
// Pure: no DOM, no network; tests/test_job_store_js.py runs it under node against Python.
import { bytes, duration, integer } from "./format.js";

// A step's metrics (controlplane/jobs/events.py: METRIC_NAMES); validation_loss only at the job's
// eval_every steps. The page draws a chart per CHART_NAMES; the validation loss rides on loss's.
export const METRIC_NAMES = ["loss", "step_seconds", "tokens_per_second", "validation_loss"];
export const CHART_NAMES = ["loss", "step_seconds", "tokens_per_second"];
export const TERMINAL = ["committed", "aborted", "rolled_back", "failed"];

// Returns {snapshot, gap, appended}: gap when an event was missed (reload the snapshot);
// appended: {name: value} of the metrics a `metrics` event added (for extendTraces).
export function applyJobEvent(snapshot, event) {
  if (event.type === "hello") return { snapshot, gap: event.seq > snapshot.seq, appended: null };
  if (event.seq <= snapshot.seq) return { snapshot, gap: false, appended: null };
  if (event.seq !== snapshot.seq + 1) return { snapshot, gap: true, appended: null };
  if (event.type === "transition") {
    const others = snapshot.transitions.filter((t) => t.id !== event.transition.id);
    const transitions = [...others, event.transition].sort((a, b) => a.id - b.id);
    return { snapshot: { ...snapshot, seq: event.seq, transitions }, gap: false, appended: null };
  }
  if (event.type === "rewind") { // a restore from the checkpoint at event.step: later steps are gone
    const metrics = {};
    for (const [name, series] of Object.entries(snapshot.metrics)) {
      const keep = series.x.map((x) => x <= event.step);
      metrics[name] = { x: series.x.filter((_, i) => keep[i]), y: series.y.filter((_, i) => keep[i]) };
    }
    return { snapshot: { ...snapshot, seq: event.seq, metrics }, gap: false, appended: null };
  }
  if (event.type !== "metrics") return { snapshot: { ...snapshot, seq: event.seq }, gap: false, appended: null };
  const metrics = { ...snapshot.metrics };
  const appended = {};
  for (const name of METRIC_NAMES) {
    const value = event[name];
    if (value === null || value === undefined) continue;
    const old = metrics[name] || { x: [], y: [] };
    metrics[name] = { x: [...old.x, event.step], y: [...old.y, value] };
    appended[name] = value;
  }
  return { snapshot: { ...snapshot, seq: event.seq, metrics }, gap: false, appended };
}

// How far a job has read its data after `step` steps (mirrors controlplane/jobs/selectors.py:
// data_progress): samples = step x global batch, tokens = samples x seq, epoch = samples /
// samples per epoch of its dataset (null: synthetic tokens).
export function dataProgress(step, globalBatch, seqLen, samplesPerEpoch) {
  const samples = (step || 0) * globalBatch;
  return { samples, tokens: samples * seqLen, epoch: samplesPerEpoch ? samples / samplesPerEpoch : null,
    samples_per_epoch: samplesPerEpoch ?? null };
}

// The job's exports (controlplane/jobs/events.py: ExportView) after an `export` event: the row
// replaced or added, newest first.
export function upsertExport(exports, row) {
  return [...exports.filter((e) => e.id !== row.id), row].sort((a, b) => b.id - a.id);
}

// What an export's row on the job page says: queued, the files written so far, or the result.
export function exportText(e) {
  const files = (n) => `${integer(n)} file${n === 1 ? "" : "s"}`;
  if (e.state === "pending") return "queued for the control worker";
  if (e.state === "running") {
    return e.files_total === null || e.files_total === undefined ? "reading the checkpoint"
      : `writing: ${files(e.files_written)} of ${integer(e.files_total)} written (${bytes(e.bytes)})`;
  }
  if (e.state === "done") return `done: ${files(e.files_written)}, ${bytes(e.bytes)} in ${duration(e.seconds)}`;
  return `failed: ${e.error || "no reason given"}`;
}

export function historyBands(sourceLayout, transitions, lastStep) {
  const committed = transitions.filter((t) => t.state === "committed" && t.step !== null && t.step !== undefined);
  const first = committed.length ? committed[0].source_layout : sourceLayout;
  if (first === null || first === undefined) return [];
  const bands = [];
  let x0 = 0;
  let layout = first;
  let startedBy = null;
  for (const t of committed) {
    bands.push({ x0, x1: t.step, layout, transition: startedBy });
    [x0, layout, startedBy] = [t.step, t.destination_layout, t.id];
  }
  bands.push({ x0, x1: Math.max(lastStep || 0, x0), layout, transition: startedBy });
  return bands;
}

const median = (values) => {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
};

export function stepTimeAround(series, step, count = 5) {
  if (!series || step === null || step === undefined) return [null, null];
  const points = series.x.map((x, i) => [x, series.y[i]]).sort((a, b) => a[0] - b[0]);
  const before = points.filter(([x]) => x <= step).map(([, y]) => y).slice(-count);
  const after = points.filter(([x]) => x > step).map(([, y]) => y).slice(1, count + 1);
  return [median(before), median(after)];
}

// One prediction per proposal and where it comes from (controlplane/jobs/proposals.py:
// reconcile): the measured step scaled to the layout when there is one, else the emulated
// step; with both, measured / emulated.
export function reconcile(p, emulated) {
  const measured = p.step_seconds;
  const emulatedStep = emulated ? emulated.step_seconds : null;
  const has = (x) => x !== null && x !== undefined;
  const [predicted, from] = has(measured) ? [measured, "measured"] : has(emulatedStep) ? [emulatedStep, "emulated"]
    : [null, null];
  return { ...p, emulated, predicted_step_seconds: predicted, predicted_from: from,
    measured_over_emulated: has(measured) && emulatedStep ? measured / emulatedStep : null };
}

// Proposals re-ranked by finished emulation runs (run.result = `dynaplane emulate --json`):
// fits (emulated peak <= capacity) first, then the emulated step time; proposals without a
// finished run keep their order after those with one.
export function rankByEmulation(proposals, runsByLayout, capacityBytes) {
  const scored = proposals.map((p, i) => {
    const run = runsByLayout[p.layout];
    const result = run && run.state === "done" ? run.result : null;
    const emulated = result ? { run: run.id ?? null, gpu_type: run.gpu_type ?? null, step_seconds: result.step_seconds,
      tokens_per_second: result.tokens_per_second, peak_bytes: result.memory.peak_bytes,
      fits: !capacityBytes || result.memory.peak_bytes <= capacityBytes } : null;
    return { ...reconcile(p, emulated || p.emulated || null), order: i };
  });
  const key = (p) => (p.emulated ? [0, p.emulated.fits ? 0 : 1, p.emulated.step_seconds, p.order] : [1, 0, 0, p.order]);
  return scored.sort((a, b) => {
    const [ka, kb] = [key(a), key(b)];
    for (let i = 0; i < ka.length; i += 1) if (ka[i] !== kb[i]) return ka[i] - kb[i];
    return 0;
  });
}
