// The cluster page's jobs table (by name) and the job picker of the node filter. A job's
// change rewrites its row; a job added or removed rebuilds both (200 rows: cheap, and rare).
import { byName } from "./cluster-model.js";

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

export class JobsTable {
  constructor(body, empty, picker) {
    this.body = body; this.empty = empty; this.picker = picker;
    this.rows = new Map(); // job id -> tr
  }

  render(model) {
    const jobs = [...model.jobs.values()].sort((a, b) => byName(a.name, b.name));
    this.empty.hidden = jobs.length > 0;
    this.rows.clear();
    this.body.replaceChildren(...jobs.map((job) => {
      const tr = el("tr");
      this._fill(tr, job);
      this.rows.set(job.id, tr);
      return tr;
    }));
    const chosen = this.picker.value;
    const names = jobs.map((j) => j.name);
    this.picker.replaceChildren(el("option", { value: "" }, "any"),
      ...names.map((name) => el("option", { value: name }, name)));
    this.picker.value = names.includes(chosen) ? chosen : "";
  }

  // One job changed in place; false when the table must be rendered again (added, removed, renamed).
  update(change) {
    const tr = change.was && change.now && change.was.name === change.now.name ? this.rows.get(change.now.id) : null;
    if (!tr) return false;
    this._fill(tr, change.now);
    return true;
  }

  _fill(tr, job) {
    tr.dataset.job = job.name;
    tr.dataset.state = job.state;
    const name = el("td");
    name.append(el("a", { href: `/jobs/${job.id}/` }, job.name));
    const gpus = el("td");
    gpus.append(el("button", { type: "button", class: "link", "data-select-job": job.name,
      title: `Show ${job.name}'s GPUs on the map` }, String(job.gpus)));
    tr.replaceChildren(name, el("td", {}, job.model), el("td", {}, job.layout), gpus,
      el("td", { "data-field": "state" }, job.state));
  }
}
