// The elastic scheduler as the pages word it (the elastic page and the job page's elastic
// card), from GET /api/elastic's answer and the job rows. Pure: no DOM;
// tests/test_elastic_view_js.py runs it under node against frontend/formatting.py.
import { DASH, duration } from "./format.js";

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

// A job's GPU range as its row stores it: a bound left empty (null) follows the job's
// current size (world_size), and the text says so.
export function rangeOf(job) {
  const lo = job.min_gpus ?? job.world_size;
  const hi = job.max_gpus ?? job.world_size;
  const follows = [job.min_gpus == null ? "min" : "", job.max_gpus == null ? "max" : ""].filter(Boolean);
  return { lo, hi, follows };
}

export function rangeText(job) {
  const { lo, hi, follows } = rangeOf(job);
  const span = lo === hi ? plural(lo, "GPU") : `${lo}–${hi} GPUs`;
  if (follows.length === 2) return `${span} (follows the current size)`;
  if (follows.length === 1) return `${span} (${follows[0]} follows the current size)`;
  return span;
}

// The jobs list's sort value of the "Elastic range" column: policy on before off, then the
// most GPUs the range allows, then the fewest (jobs-view.js compares such lists in order).
export function elasticSortKey(job) {
  const { lo, hi } = rangeOf(job);
  return [job.elastic ? 1 : 0, hi, lo];
}

// The range as the scheduler reads it (GET /api/elastic's jobs: bounds resolved; a job with
// the policy off keeps its size).
export function schedulerRangeText(job) {
  const span = job.min_gpus === job.max_gpus ? plural(job.min_gpus, "GPU") : `${job.min_gpus}–${job.max_gpus} GPUs`;
  return job.elastic || job.queued ? span : `${span} (its size: policy off)`;
}

export const policyText = (elastic) => (elastic ? "on" : "off");

// "shrink 4 → 2 GPUs", "grow 2 → 4 GPUs", "start on 4 GPUs".
export function changeText(d) {
  return d.kind === "start" ? `start on ${plural(d.gpus_to, "GPU")}` : `${d.kind} ${d.gpus_from} → ${plural(d.gpus_to, "GPU")}`;
}

// What the change is predicted to gain: a grow the training time it saves within the
// horizon (it pays for its pause within it, else it is not decided); a shrink frees GPUs
// for the change its reason names; a start starts a queued job.
export function gainText(d, settings) {
  if (d.kind === "grow") {
    return `saves ${duration(d.gain_seconds)} of training within ${duration(settings.grow_horizon_seconds)}`;
  }
  if (d.kind === "shrink") return `none for this job: frees ${plural(d.gpus_from - d.gpus_to, "GPU")}`;
  return "starts the queued job";
}

export const stepText = (d) => (d.step_seconds == null ? "not predicted (no measured step yet)" : duration(d.step_seconds));
export const pauseText = (d) => (d.kind === "start" ? DASH : duration(d.pause_seconds));

// Why a job the scheduler sees keeps its size now, if it does ("" when it may be resized).
export function holdText(job) {
  if (!job.elastic) return job.queued ? "" : "policy off: never resized";
  if (job.busy) return "busy (starting, switching, restoring or stopping): left alone";
  if (job.frozen) return job.frozen;
  if (job.backoff_until) return `backing off after ${plural(job.resize_failures, "failed resize")}`;
  return "";
}

// The job page's line about the job's pending change, from GET /api/elastic's answer.
export function pendingText(plan, jobId) {
  const d = plan.decisions.find((x) => x.job_id === jobId);
  if (d) {
    return `${changeText(d)} (${d.layout}). Reason: ${d.reason}. Predicted gain: ${gainText(d, plan.settings)}` +
      (d.kind === "start" ? "." : `; pause ${pauseText(d)}.`);
  }
  const waiting = plan.waiting.find((x) => x.job_id === jobId);
  if (waiting) return `queued, not started yet: ${waiting.reason}`;
  const job = plan.jobs.find((x) => x.id === jobId);
  const hold = job ? holdText(job) : "";
  if (!plan.enabled) return "none: the elastic scheduler is off on this control plane (DYNAPLANE_ELASTIC=0)";
  if (plan.problem) return `none: ${plan.problem}`;
  if (!job) return "none: the scheduler sees live jobs and queued ones only";
  return hold ? `none (${hold})` : "none: the scheduler would change nothing now";
}
