// The job page's elastic card: the policy switch, the GPU range (an empty bound follows the
// job's size) and the priority from the job's row, and its pending change from GET
// /api/elastic. The switch asks for confirmation, then PATCHes /api/jobs/{id}/elastic (the
// API checks it; a refusal is shown under the card) and the page reads the job again.
import { pendingText, policyText, rangeText } from "./elastic-view.js";

const $ = (id) => document.getElementById(id);

function describe(body, status) {
  if (!body) return `HTTP ${status}`;
  if (typeof body.detail === "string") return body.detail;
  return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
}

function confirmation(job) {
  if (job.elastic) {
    return ["Turn the elastic policy off", `Turn the elastic policy off for ${job.name}? The scheduler then never ` +
      `resizes it: it keeps its ${job.world_size} GPUs until you resize or stop it, and a pending change of it is ` +
      "dropped.", "Turn off"];
  }
  return ["Turn the elastic policy on", `Turn the elastic policy on for ${job.name}? The scheduler may then resize it ` +
    `within ${rangeText(job)}, giving its GPUs to jobs of higher priority and growing it onto free ones when that ` +
    "pays for the pause.", "Turn on"];
}

export function startElasticCard({ getJob, isDeleted, onChanged }) {
  let asked = 0;
  let shownFor = null; // the job's (state, size, policy) the pending line was asked for

  function showError(text) {
    $("elastic-error").textContent = text;
    $("elastic-error").hidden = !text;
  }

  async function refreshPending() {
    const mine = ++asked;
    const response = await fetch("/api/elastic", { credentials: "same-origin" }).catch(() => null);
    if (mine !== asked) return;
    const pending = $("elastic-pending");
    if (!response || !response.ok) {
      pending.textContent = `the scheduler's plan could not be read (${response ? `HTTP ${response.status}` : "offline"})`;
      return;
    }
    const plan = await response.json();
    if (mine !== asked) return;
    const job = getJob();
    pending.textContent = pendingText(plan, job.id);
    const decision = plan.decisions.find((d) => d.job_id === job.id);
    pending.dataset.kind = decision ? decision.kind : "none";
  }

  function update() {
    const job = getJob();
    const policy = $("elastic-policy");
    policy.textContent = policyText(job.elastic);
    policy.dataset.state = job.elastic ? "running" : "stopped";
    policy.dataset.elastic = String(job.elastic);
    $("elastic-range").textContent = rangeText(job);
    $("elastic-priority").textContent = String(job.priority);
    const toggle = $("elastic-toggle");
    toggle.textContent = job.elastic ? "Turn the elastic policy off…" : "Turn the elastic policy on…";
    const ended = isDeleted() || ["stopped", "failed"].includes(job.state);
    toggle.disabled = ended;
    toggle.title = ended ? `${job.name} has ended: the scheduler no longer sees it` : "";
    const key = `${job.state}/${job.world_size}/${job.elastic}/${job.min_gpus}/${job.max_gpus}/${job.priority}`;
    if (key !== shownFor) { shownFor = key; refreshPending(); }
  }

  $("elastic-toggle").addEventListener("click", () => {
    const [title, text, confirm] = confirmation(getJob());
    $("elastic-dialog-title").textContent = title;
    $("elastic-dialog-text").textContent = text;
    $("elastic-confirm").textContent = confirm;
    showError("");
    $("elastic-dialog").showModal();
  });
  $("elastic-cancel").addEventListener("click", () => $("elastic-dialog").close());
  $("elastic-confirm").addEventListener("click", async () => {
    $("elastic-dialog").close();
    const job = getJob();
    const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(`/api/jobs/${job.id}/elastic`, {
      method: "PATCH", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": token }, body: JSON.stringify({ elastic: !job.elastic }),
    });
    const body = await response.json().catch(() => null);
    if (!response.ok) { showError(`The policy switch was refused: ${describe(body, response.status)}`); return; }
    onChanged(body);
  });
  setInterval(refreshPending, 30_000); // intervals and back-offs run out with time
  return { update, refreshPending };
}
