// Compare page: pick settings and layouts, run them on the agents' emulators, follow the
// runs over /ws/emulations/ and draw the figures the server builds (/compare/data).
import {
  TERMINAL, applyEmulationEvent, comparisonQuery, emulationRequest, errorLines, follow, searchRequest, searchStatus,
  searchTop,
} from "./compare-store.js";
import { draw } from "./plots.js";
import { bytes, count, duration, percent } from "./format.js";

const initial = JSON.parse(document.getElementById("compare-initial").textContent);
let snapshot = initial.snapshot;
let figures = initial.figures;
let layouts = [...initial.settings.layouts];
const seen = new Map(); // runs seen in events before the page followed them
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function readSettings() {
  const int = (id) => Number.parseInt($(id).value, 10);
  return { model: $("f-model").value, gpu: $("f-gpu").value, gpus: int("f-gpus"), batch: int("f-batch"),
    micro: int("f-micro"), seq: int("f-seq"), recompute: $("f-recompute").value };
}

function renderLayouts() {
  $("layout-empty").hidden = layouts.length > 0;
  $("layout-list").replaceChildren(...layouts.map((layout, i) => {
    const li = el("li", { "data-layout": layout });
    const remove = el("button", { type: "button", class: "link", "aria-label": `Remove layout ${layout}` }, "Remove");
    remove.addEventListener("click", () => { layouts.splice(i, 1); renderLayouts(); });
    li.append(el("code", {}, layout), " ", remove);
    return li;
  }));
}

function addLayout() {
  const input = $("f-layout");
  const layout = input.value.replace(/\s+/g, "");
  $("form-errors").textContent = "";
  if (!layout) { $("form-errors").textContent = "Layout: type one first, e.g. tp=2,dp=2,zero=1."; input.focus(); return; }
  if (layouts.includes(layout)) { $("form-errors").textContent = `Layout ${layout} is already in the list.`; return; }
  layouts.push(layout);
  input.value = "";
  renderLayouts();
  input.focus();
}

const fmt = { ms: duration, tokens: count, pct: percent, gib: bytes };

function runLine(run, i) {
  const li = el("li", { class: `run run-${run.state}`, "data-run": String(run.id), "data-state": run.state });
  const head = el("div", { class: "run-head" });
  head.append(el("strong", {}, `#${i + 1} ${run.layout}`), el("span", { class: `badge state-${run.state}` }, run.state));
  if (run.wall_seconds != null) head.append(el("span", { class: "hint" }, duration(run.wall_seconds)));
  li.append(head);
  if (!TERMINAL.has(run.state)) {
    const bar = el("progress", { "aria-label": `Run #${i + 1} ${run.layout}: ${run.state}` });
    li.append(bar, el("span", { class: "run-message" }, run.message || (run.state === "queued" ? "waiting for an agent" : "")));
  } else if (run.state === "failed") {
    li.append(el("p", { class: "error run-error" }, run.error || "failed without a reason"),
      el("p", { class: "hint" }, "The agent reported the failure; the run was marked failed and the other " +
        "configurations went on. Change the setting it names and run the comparison again."));
  }
  return li;
}

function renderRuns() {
  $("runs-empty").hidden = snapshot.runs.length > 0;
  $("run-list").replaceChildren(...snapshot.runs.map(runLine));
  $("results-body").replaceChildren(...snapshot.runs.map((run, i) => {
    const r = run.state === "done" ? run.result : null;
    const tr = el("tr", { "data-run": String(run.id) });
    const cells = [`#${i + 1}`, run.layout, run.state, r ? fmt.ms(r.step_seconds) : "–", r ? fmt.tokens(r.tokens_per_second) : "–",
      r ? fmt.pct(r.mfu) : "–", r ? fmt.gib(r.memory.peak_bytes) : "–", r ? (r.memory.fits ? "yes" : "no") : "–"];
    for (const c of cells) tr.append(el("td", {}, c));
    return tr;
  }));
  const ids = snapshot.ids;
  const link = $("export-csv");
  if (ids.length) {
    link.href = `/compare/export.csv?runs=${ids.join(",")}`;
    link.removeAttribute("aria-disabled");
  } else {
    link.href = "#";
    link.setAttribute("aria-disabled", "true");
  }
  const busy = snapshot.runs.some((r) => !TERMINAL.has(r.state));
  $("run-compare").disabled = busy;
  $("run-compare").textContent = busy ? "Running…" : "Run comparison";
  document.body.dataset.seq = String(snapshot.seq);
  document.body.dataset.done = String(ids.length > 0 && !busy);
}

function renderFigures() {
  const table = figures ? figures.settings : [];
  const head = el("tr");
  head.append(el("th", { scope: "col" }, "Setting"), ...snapshot.runs.map((r, i) => el("th", { scope: "col" }, `#${i + 1}`)));
  $("settings-head").replaceChildren(head);
  $("settings-body").replaceChildren(...table.map((row) => {
    const tr = el("tr", { class: row.differs ? "differs" : "same", "data-setting": row.setting });
    tr.append(el("th", { scope: "row" }, row.label + (row.differs ? " (differs)" : "")));
    for (const v of row.values) tr.append(el("td", {}, String(v)));
    return tr;
  }));
  if (!window.Plotly || !figures) return;
  for (const [key, target] of [["breakdown", "breakdown-chart"], ["memory", "memory-chart"], ["throughput", "throughput-chart"]]) {
    draw(target, figures[key]);
  }
}

async function reloadData() {
  if (!snapshot.ids.length) return;
  const response = await fetch(`/compare/data?runs=${snapshot.ids.join(",")}`, { credentials: "same-origin" });
  if (!response.ok) return;
  const data = await response.json();
  if (data.snapshot.seq >= snapshot.seq) snapshot = data.snapshot;
  figures = data.figures;
  renderRuns();
  renderFigures();
  finishSearch();
}

function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  return match ? decodeURIComponent(match[1]) : "";
}

async function runComparison(event) {
  event.preventDefault();
  search = null;
  $("search-status").textContent = "";
  await submitComparison();
}

// "Take the top K from search": an agent ranks the candidate layouts (a search run, POST
// /api/emulations/search, followed over /ws/emulations/ like the emulations); they replace
// the list and run as one comparison; once every run is finished the K fastest that fit stay.
let searching = null; // the search run's id while an agent ranks the candidates
let search = null; // {top, candidates, tried} while the candidates are being emulated
async function takeTopFromSearch() {
  const settings = readSettings();
  const top = Number.parseInt($("f-top").value, 10);
  const errors = $("form-errors");
  errors.textContent = "";
  let response;
  try {
    response = await fetch("/api/emulations/search", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(searchRequest(settings, top)) });
  } catch (exc) {
    errors.textContent = `The control plane did not answer (${exc}); no search was queued. Try again.`;
    return;
  }
  const body = await response.json().catch(() => ({ detail: response.statusText }));
  if (response.status !== 201) {
    errors.replaceChildren(el("p", {}, "No search was queued; fix these and try again:"),
      ...errorLines(body).map((line) => el("p", {}, line)));
    return;
  }
  searching = body.id;
  search = null;
  $("search-top").disabled = true;
  searchMoved(seen.get(body.id) || body); // (its events may have come before the answer)
}

function searchMoved(run) {
  if (run.id !== searching) return;
  const status = searchStatus(run);
  $("search-status").textContent = status.error ? "" : status.text; // (a failure goes to the alert below)
  if (!TERMINAL.has(run.state)) return;
  searching = null;
  $("search-top").disabled = false;
  if (status.error) {
    $("form-errors").textContent = `${status.text}. Nothing was emulated; change the settings and try again.`;
    return;
  }
  layouts = status.layouts;
  renderLayouts();
  search = { top: run.result.top, candidates: run.result.candidates, tried: layouts.length };
  submitComparison().then((queued) => { if (!queued) search = null; });
}

function finishSearch() {
  if (!search || !snapshot.runs.length || snapshot.runs.some((r) => !TERMINAL.has(r.state))) return;
  const { top, candidates, tried } = search;
  search = null;
  const kept = searchTop(snapshot.runs, top);
  const left = snapshot.runs.filter((r) => !kept.includes(r)).map((r) => `${r.layout} (${r.state === "failed"
    ? "failed" : r.result.memory.fits ? "slower" : "does not fit"})`);
  $("search-status").textContent = kept.length
    ? `Search: ${tried} of ${candidates} candidates emulated; kept the ${kept.length} fastest that fit. ` +
      (left.length ? `Left out: ${left.join(", ")}.` : "")
    : `Search: none of the ${tried} candidates emulated fits; all are shown.`;
  if (!kept.length) return;
  const settings = readSettings();
  layouts = kept.map((r) => r.layout);
  const ids = kept.map((r) => r.id);
  snapshot = follow(snapshot, ids, snapshot.runs, seen);
  const query = comparisonQuery(settings, layouts, ids);
  history.replaceState(null, "", `${location.pathname}?${query}`);
  $("permalink").href = `${location.pathname}?${query}`;
  renderLayouts();
  renderRuns();
  reloadData();
}

async function reloadSearch() {
  const response = await fetch(`/api/emulations/${searching}`, { credentials: "same-origin" });
  if (response.ok) searchMoved(await response.json());
}


// POST the layouts as one comparison and follow its runs; false when nothing was queued.
async function submitComparison() {
  const errors = $("form-errors");
  errors.textContent = "";
  const settings = readSettings();
  const bad = ["gpus", "batch", "micro", "seq"].filter((k) => !(settings[k] > 0));
  if (bad.length) { errors.textContent = `${bad.join(", ")}: must be positive whole numbers.`; return false; }
  if (!layouts.length) { errors.textContent = "Add at least one layout to compare."; $("f-layout").focus(); return false; }
  $("run-compare").disabled = true;
  let response;
  try {
    response = await fetch("/api/emulations", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(emulationRequest(settings, layouts)) });
  } catch (exc) {
    errors.textContent = `The control plane did not answer (${exc}); nothing was queued. Try again.`;
    $("run-compare").disabled = false;
    return false;
  }
  const body = await response.json().catch(() => ({ detail: response.statusText }));
  if (response.status !== 201) {
    // "configs[0]: gpus: ..." names the layout the user typed: "Layout #1 (dp=2): gpus: ...".
    const lines = errorLines(body).map((line) => line.replace(/^configs\[(\d+)\](?:: |\.)?/,
      (m, n) => `Layout #${Number(n) + 1} (${layouts[Number(n)]}): `));
    errors.replaceChildren(el("p", {}, "Nothing was queued; fix these and run again:"),
      ...lines.map((line) => el("p", {}, line)));
    $("run-compare").disabled = false;
    return false;
  }
  const ids = body.runs.map((r) => r.id);
  snapshot = follow(snapshot, ids, body.runs, seen);
  figures = null;
  const query = comparisonQuery(settings, layouts, ids);
  history.replaceState(null, "", `${location.pathname}?${query}`);
  $("permalink").href = `${location.pathname}?${query}`;
  $("permalink").hidden = false;
  renderRuns();
  renderFigures();
  reloadData();
  return true;
}

function setConnection(state, text) {
  const badge = $("connection");
  badge.dataset.state = state;
  badge.textContent = text;
}

let retryMs = 500;
function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/ws/emulations/`);
  socket.onopen = () => { retryMs = 500; setConnection("live", "live"); };
  socket.onmessage = (message) => {
    const event = JSON.parse(message.data);
    if (event.type === "emulation") {
      seen.set(event.run.id, event.run);
      if (event.run.id === searching) searchMoved(event.run);
    }
    const before = snapshot;
    const result = applyEmulationEvent(snapshot, event);
    if (result.gap) {
      if (searching !== null) reloadSearch();
      // Nothing followed yet: nothing to miss. Otherwise the server's snapshot catches up.
      if (!snapshot.ids.length) snapshot = { ...snapshot, seq: event.seq };
      else reloadData();
      return;
    }
    snapshot = result.snapshot;
    if (snapshot.runs !== before.runs) {
      renderRuns();
      const finished = snapshot.runs.some((r) => TERMINAL.has(r.state) && !TERMINAL.has(before.runs.find((b) => b.id === r.id)?.state));
      if (finished) reloadData();
    }
    document.body.dataset.seq = String(snapshot.seq);
  };
  socket.onclose = (event) => {
    if (event.code === 4401) { setConnection("closed", "signed out: reload to sign in"); return; }
    setConnection("reconnecting", `disconnected; retrying in ${Math.round(retryMs / 1000)} s`);
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  };
}

$("add-layout").addEventListener("click", addLayout);
$("search-top").addEventListener("click", takeTopFromSearch);
$("f-layout").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); addLayout(); } });
$("compare-form").addEventListener("submit", runComparison);
$("export-csv").addEventListener("click", (e) => { if (!snapshot.ids.length) e.preventDefault(); });
if (snapshot.ids.length) {
  $("permalink").href = location.pathname + location.search;
  $("permalink").hidden = false;
}
renderLayouts();
renderRuns();
renderFigures();
connect();
window.dynaplaneCompare = { get snapshot() { return snapshot; }, get figures() { return figures; } };
