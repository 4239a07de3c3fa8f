// The GPU map: one small cell per GPU on a <canvas>, coloured by state, a selected job's GPUs
// outlined and the others dimmed. Redraws only the cells it is told changed; a new layout
// (nodes joined, the width changed) or another highlight redraws all (8,192 cells: ~2 ms).
// The geometry (gridLayout, cellAt, hitCell) is pure.

// Nodes in order, each a block of up to 8 cells a row (more GPUs wrap inside the block),
// blocks flowing left to right and wrapping at `width` (CSS px).
export function gridLayout(width, sizes, { cell = 10, gap = 4 } = {}) {
  const most = sizes.reduce((m, n) => Math.max(m, n), 1);
  const across = Math.min(most, 8);
  const down = Math.ceil(most / across);
  const blockW = across * cell, blockH = down * cell;
  const perLine = Math.max(1, Math.floor((width + gap) / (blockW + gap)));
  const lines = Math.ceil(sizes.length / perLine);
  return { cell, gap, across, down, blockW, blockH, perLine, lines,
    width: Math.min(sizes.length, perLine) * (blockW + gap) - gap, height: Math.max(0, lines * (blockH + gap) - gap) };
}

// The top-left corner of GPU `pos` of node `node` (ordinals).
export function cellAt(layout, node, pos) {
  const line = Math.floor(node / layout.perLine), col = node % layout.perLine;
  return { x: col * (layout.blockW + layout.gap) + (pos % layout.across) * layout.cell,
    y: line * (layout.blockH + layout.gap) + Math.floor(pos / layout.across) * layout.cell };
}

// The {node, pos} under the point (CSS px from the canvas's corner), or null (a gap, no GPU).
export function hitCell(layout, sizes, x, y) {
  if (x < 0 || y < 0) return null;
  const col = Math.floor(x / (layout.blockW + layout.gap)), line = Math.floor(y / (layout.blockH + layout.gap));
  const inX = x - col * (layout.blockW + layout.gap), inY = y - line * (layout.blockH + layout.gap);
  if (col >= layout.perLine || inX >= layout.blockW || inY >= layout.blockH) return null;
  const node = line * layout.perLine + col;
  const pos = Math.floor(inY / layout.cell) * layout.across + Math.floor(inX / layout.cell);
  return node < sizes.length && pos < sizes[node] ? { node, pos } : null;
}

// The largest cells (16 px down to 10, 8 on a phone) that keep the map within `tall` px;
// the smallest when none does (the map then scrolls in its box).
export function fitLayout(width, sizes, tall = 480) {
  const cells = width < 600 ? [14, 12, 10, 8] : [16, 14, 12, 10];
  let layout = null;
  for (const cell of cells) {
    layout = gridLayout(width, sizes, { cell, gap: cell < 10 ? 3 : 4 });
    if (layout.height <= tall) break;
  }
  return layout;
}

export class GpuMap {
  constructor(canvas, colors) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d", { alpha: true });
    this.colors = colors; // state -> CSS colour
    this.job = null;
    this.model = null;
  }

  // A new model or width: lay out again and draw every cell.
  relayout(model, width) {
    this.model = model;
    this.layout = fitLayout(width, model.sizes);
    const dpr = window.devicePixelRatio || 1;
    const { width: w, height: h } = this.layout;
    this.canvas.style.width = `${Math.max(w, 0)}px`;
    this.canvas.style.height = `${h}px`;
    this.canvas.width = Math.max(1, Math.round(w * dpr));
    this.canvas.height = Math.max(1, Math.round(h * dpr));
    this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    this.drawAll();
  }

  highlight(job) {
    this.job = job || null;
    if (this.model) this.drawAll();
  }

  drawAll() {
    this.ctx.clearRect(0, 0, this.layout.width, this.layout.height);
    for (let slot = 0; slot < this.model.slots.length; slot++) this._cell(slot, false);
    this.canvas.dataset.cells = String(this.model.slots.length);
    this.canvas.dataset.highlight = this.job || "";
  }

  draw(slots) {
    for (const slot of slots) this._cell(slot, true);
  }

  _cell(slot, clear) {
    const gpu = this.model.slots[slot];
    const { cell } = this.layout;
    const { x, y } = cellAt(this.layout, this.model.slotNode[slot], this.model.slotPos[slot]);
    const ctx = this.ctx;
    if (clear) ctx.clearRect(x, y, cell, cell);
    const mine = this.job !== null && gpu.job === this.job;
    ctx.globalAlpha = this.job !== null && !mine ? 0.22 : 1;
    ctx.fillStyle = this.colors[gpu.state] || "#888";
    ctx.fillRect(x, y, cell - 1, cell - 1);
    ctx.globalAlpha = 1;
    if (mine) {
      ctx.strokeStyle = "#111";
      ctx.lineWidth = 2;
      ctx.strokeRect(x + 1, y + 1, cell - 3, cell - 3);
    }
  }

  // Where a slot's cell is on the screen (client px), for scripts and tests.
  box(slot) {
    const { x, y } = cellAt(this.layout, this.model.slotNode[slot], this.model.slotPos[slot]);
    const at = this.canvas.getBoundingClientRect();
    return { x: at.left + x, y: at.top + y, width: this.layout.cell - 1, height: this.layout.cell - 1 };
  }

  // The slot under a point (CSS px from the canvas's corner), or null.
  slotAt(x, y) {
    if (!this.model) return null;
    const hit = hitCell(this.layout, this.model.sizes, x, y);
    if (!hit) return null;
    return this.model.firstSlot.get(this.model.order[hit.node]) + hit.pos;
  }
}
