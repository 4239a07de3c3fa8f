// The job page's Start / Stop / Delete: each asks for confirmation in a dialog, then posts
// to the API (session + CSRF). A button is enabled only in the states its action applies in
// (the `action-states` the page embeds, from controlplane/jobs/lifecycle.py); the page calls
// update() whenever the job's state changes (its live events), so they follow it.
const $ = (id) => document.getElementById(id);
export const ACTION_STATES = JSON.parse($("action-states").textContent);

const WHY_NOT = {
  start: (job) => `only a pending job can be started; ${job.name} is ${job.state}`,
  stop: (job) => `${job.name} is ${job.state}: nothing to stop`,
  delete: (job) => `stop ${job.name} first: only a pending, stopped or failed job can be deleted`,
};

function confirmation(action, job) {
  const gpus = `${job.world_size} GPU${job.world_size === 1 ? "" : "s"}`;
  const checkpoint = job.checkpoint_step === null || job.checkpoint_step === undefined ? "no checkpoint yet"
    : `its latest checkpoint is at step ${job.checkpoint_step}`;
  if (action === "start") {
    return ["Start the job", `Start ${job.name} (${job.model}, ${job.layout}) on ${gpus}? The control plane picks free ` +
      "GPUs and sends the nodes their start orders; training steps appear here as they arrive.", "Start now"];
  }
  if (action === "stop") {
    return ["Stop the job", job.state === "pending"
      ? `Stop ${job.name}? It never started, so it simply becomes stopped.`
      : `Stop ${job.name}${job.step !== null && job.step !== undefined ? ` at step ${job.step}` : ""}? Every rank ` +
        `leaves after the same step and its ${gpus} become free (${checkpoint}). A stopped job is not started ` +
        "again: create a new job (resume_from a checkpoint) to go on.", "Stop job"];
  }
  return ["Delete the job", `Delete ${job.name}? Its metrics and layout history are deleted with it; checkpoint ` +
    "files on disk are kept. This cannot be undone.", "Delete job"];
}

function describe(body, status) {
  if (!body) return `HTTP ${status}`;
  if (typeof body.detail === "string") return body.detail;
  return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
}

export function startJobActions({ getJob, onChanged }) {
  let pending = null; // the action the dialog asks about
  let deleted = false;
  const buttons = { start: $("job-start"), stop: $("job-stop"), delete: $("job-delete") };

  function showError(text) {
    $("action-error").textContent = text;
    $("action-error").hidden = !text;
  }

  function update() {
    const job = getJob();
    for (const [action, button] of Object.entries(buttons)) {
      const applies = !deleted && ACTION_STATES[action].includes(job.state);
      button.disabled = !applies;
      button.title = applies ? "" : deleted ? `${job.name} was deleted` : WHY_NOT[action](job);
    }
    buttons.stop.textContent = job.state === "stopping" ? "Stopping… (stop again)" : "Stop…";
  }

  for (const [action, button] of Object.entries(buttons)) {
    button.addEventListener("click", () => {
      const job = getJob();
      const [title, text, confirm] = confirmation(action, job);
      pending = action;
      $("action-dialog-title").textContent = title;
      $("action-dialog-text").textContent = text;
      $("action-confirm").textContent = confirm;
      $("action-confirm").className = action === "delete" ? "danger" : "primary";
      showError("");
      $("action-dialog").showModal();
    });
  }
  $("action-cancel").addEventListener("click", () => { pending = null; $("action-dialog").close(); });
  $("action-confirm").addEventListener("click", async () => {
    const action = pending;
    $("action-dialog").close();
    if (!action) return;
    pending = null;
    const job = getJob();
    const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(action === "delete" ? `/api/jobs/${job.id}` : `/api/jobs/${job.id}/${action}`, {
      method: action === "delete" ? "DELETE" : "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": token }, body: action === "delete" ? null : "{}",
    });
    if (action === "delete" && response.status === 204) {
      location.assign(`/jobs/?deleted=${encodeURIComponent(job.name)}`);
      return;
    }
    const body = await response.json().catch(() => null);
    if (!response.ok) { showError(`${action[0].toUpperCase()}${action.slice(1)} refused: ${describe(body, response.status)}`); return; }
    onChanged();
  });

  return {
    update,
    markDeleted() { deleted = true; update(); },
  };
}
