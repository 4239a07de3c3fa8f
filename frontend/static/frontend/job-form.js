// The "New job" form on the jobs list. No rule lives here: while the user types, the body
// the form would post goes to POST /api/jobs/validate (the API's own checks, nothing
// created), and each refusal is shown beside the field it names; submit posts the same
// body to POST /api/jobs (session + CSRF, as the resize flow) and opens the new job's page.
// An uploaded config.json goes to POST /api/models and becomes a choice of the model list.
import { count, integer } from "./format.js";
import { rangeText } from "./elastic-view.js";

const $ = (id) => document.getElementById(id);
const FIELDS = ["name", "model", "dataset", "init_from", "eval_every", "eval_batches", "gpus", "layout", "global_batch",
  "micro_batch", "seq_len", "max_steps", "checkpoint_interval", "elastic", "min_gpus", "max_gpus", "priority"];
const NUMBERS = ["gpus", "global_batch", "micro_batch", "seq_len", "max_steps", "checkpoint_interval", "min_gpus",
  "max_gpus", "priority", "eval_every", "eval_batches"];
// empty: left out (no dataset: synthetic tokens; no model: the initial weights' config.json; no
// initial weights: a fresh model)
const OPTIONAL = ["model", "dataset", "init_from", "eval_every", "eval_batches", "max_steps", "checkpoint_interval",
  "min_gpus", "max_gpus", "priority"];
const models = new Map([...JSON.parse($("model-catalog").textContent), ...JSON.parse($("model-stored").textContent)]
  .map((m) => [m.name, m]));
const datasets = new Map(JSON.parse($("dataset-list").textContent).map((d) => [d.name, d]));
const token = () => document.querySelector("[name=csrfmiddlewaretoken]").value;
const form = $("new-job-form");
let asked = 0; // the latest validation asked; older answers are dropped
let timer = null;

const sizeMode = () => form.querySelector("input[name=size]:checked").value;
// The form's state for tests and styles, as data-* attributes. Not through form.dataset: a form's
// named controls shadow its properties, and the Data select is named `dataset`.
const mark = (key, value) => form.setAttribute(`data-${key}`, value);

// The body POST /api/jobs gets: a number field as a number when it reads as one, else as
// typed (the API names what is wrong with it); an empty optional field left out.
function body() {
  const out = { start: $("job-start").checked };
  for (const name of FIELDS) {
    if ((name === "gpus" || name === "layout") && sizeMode() !== name) continue;
    if (name === "elastic") { out.elastic = form.elements.elastic.checked; continue; }
    const raw = form.elements[name].value.trim();
    if (raw === "" && OPTIONAL.includes(name)) continue;
    out[name] = NUMBERS.includes(name) && /^-?\d+$/.test(raw) ? Number(raw) : raw;
  }
  return out;
}

async function post(url, data) {
  const response = await fetch(url, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRFToken": token() }, body: JSON.stringify(data),
  });
  return { status: response.status, body: await response.json().catch(() => null) };
}

function setFieldError(name, messages) {
  const box = $(`error-${name}`);
  if (!box) return false;
  const text = (messages || []).join(" ");
  box.textContent = text;
  box.hidden = !text;
  const input = name === "upload-config" ? $("upload-file") : form.elements[name];
  if (input && input.setAttribute) input.setAttribute("aria-invalid", String(Boolean(text)));
  box.closest(".field, [data-field]")?.toggleAttribute("data-invalid", Boolean(text));
  return true;
}

function setFormError(text) {
  $("new-job-error").textContent = text;
  $("new-job-error").hidden = !text;
}

// Show a 400 body: each field's messages beside it (every field starts filled in, so a
// refusal is about what the user changed, wherever the API places it: a bigger model is
// refused at `gpus`); what names no field of the form goes above the buttons.
function showErrors(errors) {
  const rest = [];
  for (const name of FIELDS) setFieldError(name, errors[name]);
  for (const [key, messages] of Object.entries(errors)) {
    if (FIELDS.includes(key)) continue;
    rest.push(key === "detail" || key === "non_field_errors" ? [].concat(messages).join(" ")
      : `${key}: ${[].concat(messages).join(" ")}`);
  }
  setFormError(rest.join(" "));
  const invalid = FIELDS.filter((name) => errors[name]);
  mark("invalid-fields", invalid.join(" "));
  return invalid;
}

function describeModel() {
  if (form.elements.model.value === "") {
    $("model-facts").textContent = "the model the initial weights' config.json describes (stored as a model)";
    return;
  }
  const m = models.get(form.elements.model.value);
  $("model-facts").textContent = !m ? "" : [m.family, m.params ? `${integer(m.params)} parameters` : "",
    m.heads ? `${m.heads} heads (${m.kv_heads} KV: tensor parallelism divides them)` : "",
    m.positions ? `${m.positions} learned positions` : ""].filter(Boolean).join(" · ");
}

function describeDataset() {
  const d = datasets.get(form.elements.dataset.value);
  $("dataset-facts").textContent = !d ? "deterministic random tokens with a learnable pattern"
    : `${count(d.tokens)} tokens · ${integer(d.documents)} documents · vocab ${integer(d.vocab_size)} (${d.tokenizer})`;
}

async function validate() {
  const mine = ++asked;
  const { status, body: answer } = await post("/api/jobs/validate", body());
  if (mine !== asked) return; // the form changed meanwhile: a newer answer is on its way
  mark("checked", String(mine));
  if (status === 200) {
    showErrors({});
    $("new-job-preview").textContent = `Runs ${answer.layout} on ${answer.world_size} GPU${answer.world_size === 1 ? "" : "s"}` +
      (answer.dataset ? ` on ${answer.dataset} (${integer(answer.samples_per_epoch)} samples of ${integer(answer.seq_len)}` +
        " tokens per epoch)" : " on synthetic tokens") +
      `, ${answer.max_steps ? `${answer.max_steps} steps` : "until stopped"}` +
      (answer.init_from ? `, starting from ${answer.init_from} (${answer.model})` : "") +
      (answer.eval_every ? `, the validation loss every ${answer.eval_every} steps over ` +
        `${answer.eval_batches} batch${answer.eval_batches === 1 ? "" : "es"} ` +
        `(${integer(answer.validation_samples)} validation samples)` : "") +
      (answer.checkpoint_interval ? `, a checkpoint every ${answer.checkpoint_interval} steps` : ", no checkpoints") +
      (answer.elastic ? `; elastic within ${rangeText(answer)}` : "; not elastic") +
      (answer.priority ? `, priority ${answer.priority}.` : ".");
    mark("valid", "true");
  } else {
    $("new-job-preview").textContent = "";
    mark("valid", "false");
    showErrors(answer || { detail: `HTTP ${status}` });
  }
}

function validateSoon() {
  mark("valid", "pending");
  clearTimeout(timer);
  timer = setTimeout(validate, 250);
}

form.addEventListener("input", (event) => {
  if (event.target.name === "model") describeModel();
  if (event.target.name === "dataset") describeDataset();
  if (event.target.closest("#upload")) return;
  validateSoon();
});
form.addEventListener("change", (event) => {
  if (event.target.name === "size") {
    $("size-gpus").hidden = sizeMode() !== "gpus";
    $("size-layout").hidden = sizeMode() !== "layout";
    setFieldError("gpus", null);
    setFieldError("layout", null);
  }
  if (event.target.closest("#upload")) return;
  validateSoon();
});

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearTimeout(timer);
  asked += 1; // a validation still in flight must not overwrite what the submit answers
  $("new-job-submit").disabled = true;
  try {
    const { status, body: answer } = await post("/api/jobs", body());
    if (status === 201) {
      location.assign(`/jobs/${answer.id}/`);
      return;
    }
    if (status === 400) {
      const invalid = showErrors(answer || {});
      if (invalid.length) form.elements[invalid[0]].focus();
    } else {
      const detail = answer && answer.detail ? answer.detail : `HTTP ${status}`;
      setFormError(status === 409 && $("job-start").checked
        ? `${detail}. Free GPUs first (stop or shrink a job), or clear "Start it now" to create the job pending.`
        : detail);
    }
  } finally {
    $("new-job-submit").disabled = false;
  }
});

function toggle(open) {
  $("new-job").hidden = !open;
  $("new-job-open").setAttribute("aria-expanded", String(open));
  if (open) { describeModel(); describeDataset(); form.elements.name.focus(); validateSoon(); }
}
$("new-job-open").addEventListener("click", () => toggle($("new-job").hidden));
$("new-job-cancel").addEventListener("click", () => { toggle(false); $("new-job-open").focus(); });

// Upload: the file is read here (it must be JSON to be sent as JSON), checked and stored by
// POST /api/models; the stored model is then chosen in the list.
$("upload-file").addEventListener("change", () => {
  const file = $("upload-file").files[0];
  if (file && !$("upload-name").value) {
    $("upload-name").value = file.name.replace(/\.json$/i, "").replace(/[^A-Za-z0-9._-]+/g, "-")
      .replace(/^[^A-Za-z0-9]+/, "").slice(0, 100) || "model";
    if ($("upload-name").value === "config") $("upload-name").value = "";
  }
});
$("upload-button").addEventListener("click", async () => {
  setFieldError("upload-config", null);
  setFieldError("upload-name", null);
  $("upload-status").textContent = "";
  const file = $("upload-file").files[0];
  if (!file) { setFieldError("upload-config", ["choose a config.json file first"]); return; }
  let config;
  try {
    config = JSON.parse(await file.text());
  } catch (exc) {
    setFieldError("upload-config", [`${file.name} is not JSON: ${exc.message}`]);
    return;
  }
  const { status, body: answer } = await post("/api/models", { name: $("upload-name").value.trim(), config });
  if (status !== 201) {
    const errors = answer || {};
    setFieldError("upload-name", errors.name);
    setFieldError("upload-config", errors.config || (errors.detail ? [errors.detail] : errors.name ? null
      : [`HTTP ${status}`]));
    return;
  }
  models.set(answer.name, answer);
  const option = new Option(answer.name, answer.name);
  $("stored-models").append(option);
  form.elements.model.value = answer.name;
  describeModel();
  $("upload-status").textContent = `Stored as ${answer.name}: ${integer(answer.params)} parameters; chosen above.`;
  validateSoon();
});

describeModel();
describeDataset();
window.dynaplaneJobForm = { validate };
