// The job page's elastic card: the policy switch, the GPU range (an empty bound follows the
// job's size) and the priority from the job's row, and its pending change from GET
// /api/elastic. The switch asks for confirmation, then PATCHes /api/jobs/{id}/elastic (the
// API checks it; a refusal is shown under the card) and the page reads the job again. The
// form edits the range (an empty bound: the job's size) and the priority with the same PATCH;
// the API's words for a refused field are shown beside that field.
import { pendingText, policyText, rangeText } from "./elastic-view.js";

const $ = (id) => document.getElementById(id);
const FORM_FIELDS = ["min_gpus", "max_gpus", "priority"];

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

  function showFieldErrors(problems) {
    for (const field of FORM_FIELDS) {
      const box = $(`elastic-error-${field}`);
      const text = problems[field] ? [].concat(problems[field]).join(" ") : "";
      box.textContent = text;
      box.hidden = !text;
      $(`elastic-set-${field}`).setAttribute("aria-invalid", String(Boolean(text)));
    }
  }

  // The form shows the job's settings, refilled when they change (elsewhere too) unless the
  // user has typed since: their edit is kept until saved.
  let filledFor = null;
  let edited = false;
  function fillForm(job) {
    const key = `${job.min_gpus}/${job.max_gpus}/${job.priority}`;
    if (key === filledFor || edited) return;
    filledFor = key;
    $("elastic-set-min_gpus").value = job.min_gpus ?? "";
    $("elastic-set-max_gpus").value = job.max_gpus ?? "";
    $("elastic-set-priority").value = String(job.priority);
    for (const field of ["min_gpus", "max_gpus"]) $(`elastic-set-${field}`).placeholder = String(job.world_size);
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
    for (const control of $("elastic-form").elements) control.disabled = ended;
    $("elastic-save").title = toggle.title;
    fillForm(job);
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
  $("elastic-form").addEventListener("input", () => { edited = true; $("elastic-saved").textContent = ""; });
  $("elastic-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const job = getJob();
    const bound = (id) => ($(id).value.trim() === "" ? null : $(id).value.trim());
    const body = { min_gpus: bound("elastic-set-min_gpus"), max_gpus: bound("elastic-set-max_gpus"),
      priority: $("elastic-set-priority").value.trim() };
    showError("");
    showFieldErrors({});
    $("elastic-saved").textContent = "saving…";
    const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(`/api/jobs/${job.id}/elastic`, {
      method: "PATCH", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": token }, body: JSON.stringify(body),
    }).catch(() => null);
    const reply = response ? await response.json().catch(() => null) : null;
    if (!response || !response.ok) {
      $("elastic-saved").textContent = "";
      const fields = reply && typeof reply === "object" ? reply : {};
      showFieldErrors(fields);
      const rest = Object.fromEntries(Object.entries(fields).filter(([k]) => !FORM_FIELDS.includes(k)));
      if (!response) showError("The change was not sent: offline");
      else if (!FORM_FIELDS.some((f) => fields[f]) || Object.keys(rest).length) {
        showError(`The change was refused: ${describe(Object.keys(rest).length ? rest : reply, response.status)}`);
      }
      return;
    }
    edited = false;
    filledFor = null;
    $("elastic-saved").textContent = "saved";
    onChanged(reply);
  });
  setInterval(refreshPending, 30_000); // intervals and back-offs run out with time
  return { update, refreshPending };
}
