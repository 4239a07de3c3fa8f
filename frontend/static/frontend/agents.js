// The Agents page: the issue form posts to POST /api/agent-tokens (session + CSRF) and shows the
// token once with the command to run on the agent's host, or each refusal beside the field it
// names; Revoke asks first, then POST /api/agent-tokens/{key id}/revoke.
const $ = (id) => document.getElementById(id);
const csrf = () => document.querySelector("[name=csrfmiddlewaretoken]").value;
const form = $("issue-form");
const FIELDS = ["node", "note"];

async function send(url, data) {
  const response = await fetch(url, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRFToken": csrf() },
    body: JSON.stringify(data),
  });
  return { status: response.status, body: await response.json().catch(() => null) };
}

function showErrors(errors) {
  for (const name of FIELDS) {
    const text = [].concat(errors[name] || []).map(String).join(" ");
    $(`error-${name}`).textContent = text;
    $(`error-${name}`).hidden = !text;
    form.elements[name].setAttribute("aria-invalid", String(Boolean(text)));
  }
  const rest = Object.entries(errors).filter(([key]) => !FIELDS.includes(key))
    .map(([key, v]) => (key === "detail" ? [].concat(v).join(" ") : `${key}: ${[].concat(v).join(" ")}`));
  $("issue-error").textContent = rest.join(" ");
  $("issue-error").hidden = rest.length === 0;
  return FIELDS.filter((name) => errors[name]);
}

function addRow(row) {
  const tr = document.createElement("tr");
  tr.id = `token-${row.key_id}`;
  tr.dataset.key = row.key_id;
  const cells = [row.node, row.key_id, "just now", row.created_by || "–", "–", "valid", row.note];
  for (const [i, text] of cells.entries()) {
    const td = document.createElement("td");
    const inner = document.createElement(i === 0 ? "strong" : i === 1 ? "code" : "span");
    inner.textContent = text;
    td.append(inner);
    if (i === 5) td.dataset.field = "state";
    tr.append(td);
  }
  const td = document.createElement("td");
  td.append(revokeButton(row.key_id, row.node));
  tr.append(td);
  $("tokens-body").prepend(tr);
  $("tokens-table").hidden = false;
  $("tokens-empty").hidden = true;
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  $("issue-submit").disabled = true;
  try {
    const { status, body } = await send("/api/agent-tokens",
      { node: form.elements.node.value.trim(), note: form.elements.note.value.trim() });
    if (status === 201) {
      showErrors({});
      $("issued-node").textContent = body.node;
      $("issued-token").textContent = body.token;
      $("issued-command").textContent =
        `DYNAPLANE_AGENT_TOKEN=${body.token} dynaplane agent --join ${$("issued-command").dataset.join}`;
      $("issued").hidden = false;
      addRow(body);
      form.reset();
      return;
    }
    const invalid = showErrors(body && typeof body === "object" ? body : { detail: `HTTP ${status}` });
    if (invalid.length) form.elements[invalid[0]].focus();
  } finally {
    $("issue-submit").disabled = false;
  }
});

let pending = null;
function revokeButton(key, node) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "danger";
  button.textContent = "Revoke…";
  button.dataset.revoke = key;
  button.dataset.node = node;
  button.addEventListener("click", () => ask(button));
  return button;
}
function ask(button) {
  pending = button;
  $("revoke-dialog-text").textContent = `Revoke token ${button.dataset.revoke} of node ${button.dataset.node}? ` +
    "An agent running with it is refused from then on; it needs a new token to take part again.";
  $("revoke-dialog").showModal();
}
for (const button of document.querySelectorAll("[data-revoke]")) button.addEventListener("click", () => ask(button));
$("revoke-cancel").addEventListener("click", () => { pending = null; $("revoke-dialog").close(); });
$("revoke-confirm").addEventListener("click", async () => {
  $("revoke-dialog").close();
  if (!pending) return;
  const { status, body } = await send(`/api/agent-tokens/${pending.dataset.revoke}/revoke`, {});
  if (status === 200) {
    pending.closest("tr").querySelector("[data-field=state]").textContent = "revoked just now";
    pending.remove();
  } else {
    $("tokens-error").textContent = body && body.detail ? body.detail : `HTTP ${status}`;
    $("tokens-error").hidden = false;
  }
  pending = null;
});
