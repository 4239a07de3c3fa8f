// The job page's "Export to Hugging Face" card. No rule lives here: the button posts to
// POST /api/jobs/{id}/export (session + CSRF) with the step typed (empty: the latest
// checkpoint), and the API's refusal (no checkpoint yet, another export under way, no complete
// checkpoint of that step, a taken name) is shown in its words. The job's exports, embedded by
// the page, follow its stream's `export` events (files written of the total, bytes, seconds,
// the directory under the exports root, or the error); `checkpoint` events move the line that
// says which checkpoint an export would take.
import { exportText, upsertExport } from "./job-store.js";

const $ = (id) => document.getElementById(id);
const token = () => document.querySelector("[name=csrfmiddlewaretoken]").value;

function describe(body, status) {
  if (!body) return `HTTP ${status}`;
  if (typeof body.detail === "string") return body.detail;
  return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
}

function row(e) {
  const li = document.createElement("li");
  Object.assign(li.dataset, { export: String(e.id), state: e.state });
  const head = document.createElement("span");
  head.className = "export-head";
  head.textContent = `#${e.id} · step ${e.checkpoint_step} → `;
  const path = document.createElement("code");
  path.textContent = e.path;
  path.title = "under the exports root (DYNAPLANE_EXPORTS_ROOT)";
  head.append(path);
  const text = document.createElement("span");
  text.className = "export-text";
  text.dataset.field = "export-status";
  text.textContent = ` ${exportText(e)}`;
  li.append(head, text);
  if (e.state === "running" || e.state === "pending") {
    const bar = document.createElement("progress");
    bar.max = e.files_total || 1;
    bar.value = e.files_written;
    bar.setAttribute("aria-label", `export ${e.id}: files written`);
    li.append(bar);
  }
  return li;
}

export function startExportCard({ getJob, exports: initial, onEvent }) {
  let exports = [...initial];
  let checkpointStep = getJob().checkpoint_step;

  function drawCheckpoint() {
    const job = getJob();
    const step = checkpointStep ?? job.checkpoint_step;
    $("export-checkpoint").textContent = step !== null && step !== undefined
      ? `Exports the latest complete checkpoint (step ${step}) unless a step is given.`
      : job.checkpoint_interval ? `No checkpoint yet: the first comes at step ${job.checkpoint_interval}.`
        : "No checkpoint yet: this job's checkpoint_interval is 0 (checkpoints off), so it has none to export.";
  }

  function draw() {
    drawCheckpoint();
    $("export-list").replaceChildren(...exports.map(row));
    $("export-empty").hidden = exports.length > 0;
  }

  function showError(text) {
    $("export-error").textContent = text;
    $("export-error").hidden = !text;
  }

  onEvent((event) => {
    if (event.type === "export" && event.export.job === getJob().id) {
      exports = upsertExport(exports, event.export);
      draw();
    } else if (event.type === "checkpoint") {
      checkpointStep = Math.max(checkpointStep ?? 0, event.step);
      drawCheckpoint();
    }
  });

  $("export-form").addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    showError("");
    const raw = $("export-step").value.trim();
    const body = raw === "" ? {} : { checkpoint_step: /^\d+$/.test(raw) ? Number(raw) : raw };
    $("export-button").disabled = true;
    try {
      const response = await fetch(`/api/jobs/${getJob().id}/export`, {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": token() }, body: JSON.stringify(body),
      });
      const answer = await response.json().catch(() => null);
      if (response.status === 202) {
        exports = upsertExport(exports, answer);
        draw();
      } else {
        showError(describe(answer, response.status));
      }
    } finally {
      $("export-button").disabled = false;
    }
  });
  // After a missed event (the page reloads its live snapshot): the exports as the API has them.
  async function reload() {
    const response = await fetch(`/api/jobs/${getJob().id}/exports?limit=50`, { credentials: "same-origin" });
    if (response.ok) {
      exports = (await response.json()).results;
      draw();
    }
  }

  draw();
  return { reload, get exports() { return exports; } };
}
