// The cluster page's node list: the filtered nodes, grouped by state, a page of rows at a time
// (each row: the node, its host stats and a chip per GPU). A GPU event changes its chip in
// place when its row is shown; anything that moves nodes between groups re-renders the shown
// rows (at most `limit`, never the whole cluster).
import { filterNodes } from "./cluster-model.js";
import { bytes, hostText, integer as count } from "./format.js";

const PAGE = 50;

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

export const gpuLabel = (gpu) => `${gpu.node} GPU ${gpu.index}: ${gpu.state}${gpu.job ? ` (job ${gpu.job})` : ""}`;

export class NodeList {
  constructor(root, countLine, more) {
    this.root = root; this.countLine = countLine; this.more = more;
    this.limit = PAGE;
    this.chips = new Map(); // GPU key -> its chip, for the rows shown
    this.rows = new Map(); // node name -> its row, for the rows shown
    more.addEventListener("click", () => { this.limit += 4 * PAGE; this.onMore?.(); });
  }

  render(model, filter, job) {
    const groups = filterNodes(model, filter);
    const matched = groups.reduce((n, g) => n + g.nodes.length, 0);
    this.chips.clear(); this.rows.clear();
    let left = this.limit;
    const parts = [];
    for (const group of groups) {
      if (left <= 0) break;
      const names = group.nodes.slice(0, left);
      left -= names.length;
      const head = { class: `node-group-head node-group-${group.state}`, role: "row", "data-group": group.state };
      parts.push(el("div", head,
        `${group.state} · ${count(group.nodes.length)} node${group.nodes.length === 1 ? "" : "s"}`));
      for (const name of names) parts.push(this._row(model, name, job));
    }
    this.root.replaceChildren(...parts);
    const total = model.order.length;
    const shown = Math.min(matched, this.limit);
    this.countLine.textContent = !total ? "" : matched === total && shown === total ? `${count(total)} nodes`
      : `${count(shown)} shown of ${count(matched)} matching (${count(total)} nodes)`;
    this.root.dataset.matched = String(matched);
    this.more.hidden = matched <= this.limit;
    this.more.textContent = `Show ${count(Math.min(4 * PAGE, matched - this.limit))} more nodes`;
  }

  _row(model, name, job) {
    const node = model.nodes.get(name) || { name, state: "unknown", host: "", device: "", gpu_count: 0 };
    const row = el("div", { class: "node-row", role: "row", "data-node": name, "data-state": node.state });
    const head = el("div", { class: `node-head node-${node.state}`, role: "rowheader",
      title: `${node.host} · ${node.device} · ${node.gpu_count} GPUs, ${bytes(node.gpu_memory_bytes || 0)}` });
    head.append(el("strong", {}, name), el("span", { class: "node-state" }, node.state));
    const host = hostText(node);
    if (host) head.append(el("span", { class: "node-host", "data-field": "host-stats" }, host));
    row.append(head);
    const cells = el("div", { class: "node-gpus", role: "cell" });
    for (const gpu of model.nodeGpus(name)) {
      const chip = el("span", { class: "gpu", tabindex: "0", "data-gpu": `${gpu.node}/${gpu.index}` });
      chip.append(el("span", { class: "gpu-index" }, String(gpu.index)), el("span", { class: "gpu-job" }));
      this._paint(chip, gpu, job);
      this.chips.set(`${gpu.node}/${gpu.index}`, chip);
      cells.append(chip);
    }
    row.append(cells);
    this.rows.set(name, row);
    return row;
  }

  _paint(chip, gpu, job) {
    const label = `${gpuLabel(gpu)}, ${gpu.model_name}, ${bytes(gpu.memory_bytes)}`;
    chip.className = `gpu gpu-${gpu.state}`;
    chip.dataset.state = gpu.state;
    chip.dataset.job = gpu.job || "";
    chip.dataset.highlight = String(Boolean(job) && gpu.job === job);
    chip.title = label;
    chip.setAttribute("aria-label", label);
    chip.lastChild.textContent = gpu.job || "";
  }

  // A node changed but stays where it is (same state, still matching): its row again, if shown.
  updateNode(model, name, job) {
    const row = this.rows.get(name);
    if (row) row.replaceWith(this._row(model, name, job));
  }

  // One GPU changed: its chip, if shown.
  updateGpu(gpu, job) {
    const chip = this.chips.get(`${gpu.node}/${gpu.index}`);
    if (chip) this._paint(chip, gpu, job);
  }

  highlight(model, job) {
    for (const [key, chip] of this.chips) this._paint(chip, model.gpus.get(key), job);
  }
}
