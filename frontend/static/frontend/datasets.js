// The Datasets page: the register form posts to POST /api/datasets (session + CSRF) and shows
// each refusal beside the field it names, in the API's words; a registered dataset reloads the
// list. Delete (a dataset no job names) asks first, then DELETE /api/datasets/{id}.
const $ = (id) => document.getElementById(id);
const token = () => document.querySelector("[name=csrfmiddlewaretoken]").value;
const form = $("register-form");
const FIELDS = ["path", "name"];

async function send(method, url, data) {
  const response = await fetch(url, {
    method, credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRFToken": token() },
    body: data === undefined ? undefined : JSON.stringify(data),
  });
  return { status: response.status, body: await response.json().catch(() => null) };
}

function setFieldError(name, messages) {
  const box = $(`error-${name}`);
  const text = (messages || []).map(String).join(" ");
  box.textContent = text;
  box.hidden = !text;
  form.elements[name].setAttribute("aria-invalid", String(Boolean(text)));
  box.closest(".field").toggleAttribute("data-invalid", Boolean(text));
}

function showErrors(errors) {
  for (const name of FIELDS) setFieldError(name, errors[name]);
  const rest = Object.entries(errors).filter(([key]) => !FIELDS.includes(key))
    .map(([key, v]) => (key === "detail" ? [].concat(v).join(" ") : `${key}: ${[].concat(v).join(" ")}`));
  $("register-error").textContent = rest.join(" ");
  $("register-error").hidden = rest.length === 0;
  return FIELDS.filter((name) => errors[name]);
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  $("register-submit").disabled = true;
  $("register-status").textContent = "checking the directory…";
  try {
    const { status, body } = await send("POST", "/api/datasets",
      { path: form.elements.path.value, name: form.elements.name.value.trim() });
    if (status === 201) {
      showErrors({});
      $("register-status").textContent = `Registered ${body.name}.`;
      location.assign(`/datasets/#dataset-${body.name}`);
      location.reload();
      return;
    }
    $("register-status").textContent = "";
    const invalid = showErrors(body && typeof body === "object" ? body : { detail: `HTTP ${status}` });
    if (invalid.length) form.elements[invalid[0]].focus();
  } finally {
    $("register-submit").disabled = false;
  }
});

let pending = null;
for (const button of document.querySelectorAll("[data-delete]")) {
  button.addEventListener("click", () => {
    pending = button;
    $("delete-dialog-text").textContent = `Forget the dataset ${button.dataset.name}? Its directory and files stay ` +
      "under the data root; it can be registered again.";
    $("delete-dialog").showModal();
  });
}
$("delete-cancel").addEventListener("click", () => { pending = null; $("delete-dialog").close(); });
$("delete-confirm").addEventListener("click", async () => {
  $("delete-dialog").close();
  if (!pending) return;
  const { status, body } = await send("DELETE", `/api/datasets/${pending.dataset.delete}`);
  if (status === 204) {
    pending.closest("tr").remove();
    $("datasets-table").hidden = !document.querySelector("#datasets-body tr");
    $("datasets-empty").hidden = !$("datasets-table").hidden;
  } else {
    $("datasets-error").textContent = body && body.detail ? body.detail : `HTTP ${status}`;
    $("datasets-error").hidden = false;
  }
  pending = null;
});
