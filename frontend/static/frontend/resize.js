// The click-to-resize flow on the job page: GPU count -> ranked proposals -> plan preview
// -> confirm dialog -> POST resize -> live progress -> result.
import { rankByEmulation, stepTimeAround, TERMINAL } from "./job-store.js";
import { draw } from "./plots.js";
import { bytes as mib, duration as secs, rate, sig } from "./format.js";

const EMULATE_TOP = 3;
const STEPS = ["planned", "preparing", "ready", "transferring", "verifying", "committed"];
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

function describeError(body, status) {
  if (!body) return `HTTP ${status}`;
  if (typeof body.detail === "string") return body.detail;
  if (body.error) return body.error;
  return Object.entries(body).map(([k, v]) => `${k}: ${[].concat(v).join(" ")}`).join("; ");
}

function showError(text) {
  const box = $("resize-error");
  box.textContent = text;
  box.hidden = !text;
}

function fillDl(dl, pairs) {
  dl.replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]));
}

// Where the flow applies (from the page's action states, controlplane/jobs/lifecycle.py):
// proposals and plan previews while the job starts or runs, the resize itself only while
// it runs. Elsewhere (pending, switching, stopping, stopped, failed, deleted) the controls
// are disabled with the reason beside them, and a plan on screen is cleared: it was made
// for a layout the job no longer runs (after a commit) or cannot leave (stopped).
function unavailableText(job, state) {
  if (state === "switching") return "A layout switch is in progress: its progress is below. Resize again once it ends.";
  if (state === "pending") return `${job.name} is pending: start it first; a running job can be resized.`;
  if (state === "deleted") return `${job.name} was deleted.`;
  return `Resize applies to a running job; ${job.name} is ${state}.`;
}

// measured / emulated as "36×" (3 significant digits; "1/36" read as 0.0278×).
const ratioText = (r) => `${sig(r)}×`;

export function startResizeFlow({ getJob, getLive, onEvent, getState, states }) {
  const input = $("resize-gpus");
  let chosen = null;
  let proposals = null; // the last GET proposals answer
  let runs = {}; // layout -> emulation run
  let tracking = null; // transition id being followed

  let shownFor = null; // the state the controls were last set up for
  let asked = null; // the GPU count proposals were last asked for (kept while a switch hides them)
  let proposalsLayout = null; // the layout the job ran when they were asked for
  let refetchDue = false; // a switch committed or the layout changed since: ask again
  let fetches = 0;

  function clearPlan() {
    chosen = null;
    proposals = null;
    $("proposals-section").hidden = true;
    $("plan-section").hidden = true;
    delete $("plan-section").dataset.layout;
    $("proposals-body").replaceChildren();
    $("resize-open").textContent = "Resize…";
    if ($("resize-dialog").open) $("resize-dialog").close();
  }

  function update() {
    const state = getState();
    if (asked !== null && getJob().layout !== proposalsLayout) {
      refetchDue = true;
      proposalsLayout = getJob().layout;
    }
    setUp(state);
    if (refetchDue && asked !== null && states.preview.includes(state)) refreshProposals();
  }

  function setUp(state) {
    if (state === shownFor) return;
    const wasPreviewable = shownFor !== null && states.preview.includes(shownFor);
    shownFor = state;
    const previewable = states.preview.includes(state);
    const resizable = states.resize.includes(state);
    for (const control of $("resize-form").elements) control.disabled = !previewable;
    $("emulate-button").disabled = !previewable;
    $("resize-open").disabled = !resizable;
    $("resize-open").title = resizable ? "" : unavailableText(getJob(), state);
    const note = $("resize-unavailable");
    note.hidden = previewable && !(state === "starting");
    note.textContent = state === "starting" ? `${getJob().name} is starting: proposals and plans can be previewed; ` +
      "the resize itself waits until it runs." : previewable ? "" : unavailableText(getJob(), state);
    $("resize-card").dataset.state = state;
    if (!previewable) { clearPlan(); showError(""); }
    if (previewable && !wasPreviewable) input.value = getJob().world_size;
  }

  const clamp = (n) => Math.max(Number(input.min) || 1, Math.min(Number(input.max) || 65536, n));
  $("resize-minus").addEventListener("click", () => { input.value = clamp(Number(input.value) - 1); });
  $("resize-plus").addEventListener("click", () => { input.value = clamp(Number(input.value) + 1); });

  $("resize-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!states.preview.includes(getState())) return;
    await fetchProposals(Number(input.value));
    $("proposals-section").querySelector("button.preview")?.focus();
  });

  // The proposals (and a plan previewed from them) are made for the layout the job runs: once
  // a switch commits or the layout changes otherwise (an elastic resize), the plan on screen
  // is dropped and the proposals are asked for again, for the GPU count in the form, as soon
  // as the job can be previewed again.
  function refreshProposals() {
    refetchDue = false;
    clearPlan();
    fetchProposals(Number(input.value));
  }

  async function fetchProposals(gpus) {
    showError("");
    $("plan-section").hidden = true;
    const mine = ++fetches;
    asked = gpus;
    proposalsLayout = getJob().layout;
    const response = await fetch(`/api/jobs/${getJob().id}/proposals?gpus=${gpus}`, { credentials: "same-origin" });
    const body = await response.json().catch(() => null);
    if (mine !== fetches) return; // a newer ask is under way
    if (!response.ok) { $("proposals-section").hidden = true; showError(describeError(body, response.status)); return; }
    proposals = body;
    proposalsLayout = body.current_layout || proposalsLayout;
    $("proposals-section").dataset.layout = proposalsLayout;
    $("proposals-section").dataset.gpus = String(gpus);
    $("proposals-section").dataset.fetches = String(mine);
    runs = {};
    $("ranking-note").textContent = body.predictor === "rule"
      ? `Ranked by rule, not by the emulator: ${body.ranking}. ` + (body.measured_step_seconds === null
        ? "No step measured on this layout yet: the predicted step is the emulator's where an emulation of the " +
          "layout exists" : `The predicted step scales ${secs(body.measured_step_seconds)}, the median of the ` +
        `last ${body.recent_steps} measured steps on ${body.current_layout}, to each layout; where an emulation of ` +
        "the layout exists, its step and measured/emulated are beside it (the emulator models the GPU type it " +
        "names)") + "; memory counts model state only (no activations)."
      : `Ranked by ${body.predictor}.`;
    $("emulate-status").textContent = "";
    renderProposals(body.proposals);
    $("proposals-section").hidden = false;
  }

  function renderProposals(list) {
    const cap = proposals.capacity_bytes ? ` of ${mib(proposals.capacity_bytes)}` : "";
    $("proposals-body").replaceChildren(...list.map((p, i) => {
      const tr = el("tr", { "data-layout": p.layout, "data-fits": String(p.emulated ? p.emulated.fits : p.fits) });
      const run = runs[p.layout];
      const gpu = p.emulated && p.emulated.gpu_type ? `${p.emulated.gpu_type}: ` : "";
      const ratio = p.measured_over_emulated ? ` · measured/emulated ${ratioText(p.measured_over_emulated)}` : "";
      const emulated = run && run.state !== "done" ? (run.state === "failed" ? `failed: ${run.error}` : `${run.state}…`)
        : p.emulated ? `${gpu}${secs(p.emulated.step_seconds)} · peak ${mib(p.emulated.peak_bytes)}${ratio}` : "–";
      const from = p.predicted_from === "measured" ? "measured, scaled"
        : p.predicted_from === "emulated" ? `emulated${p.emulated.gpu_type ? `, ${p.emulated.gpu_type}` : ""}` : "";
      const tokens = p.predicted_from === "emulated" ? p.emulated.tokens_per_second : p.tokens_per_second;
      const predicted = el("td", { "data-from": p.predicted_from || "none" }, secs(p.predicted_step_seconds));
      if (from) predicted.append(el("span", { class: "source" }, ` (${from})`));
      tr.append(el("td", {}, String(i + 1)), el("td", {}, p.layout + (p.layout === proposals.default_layout ? " (default)" : "")),
        predicted);
      for (const v of [tokens ? rate(tokens, "tokens") : "–",
        `${mib(p.state_bytes_per_gpu)}${cap}`, p.fits ? "fits" : "does not fit"]) tr.append(el("td", {}, v));
      tr.append(el("td", { "data-field": "emulated" }, emulated));
      const td = el("td");
      const button = el("button", { type: "button", class: "preview", "aria-label": `Preview the switch to ${p.layout}` },
        "Preview plan");
      button.addEventListener("click", () => preview(p.layout));
      td.append(button);
      tr.append(td);
      return tr;
    }));
  }

  // Emulator predictions for the top proposals: POST /api/emulations, then follow each run
  // until done or failed, re-ranking the table as results arrive.
  $("emulate-button").addEventListener("click", async () => {
    if (!proposals) return;
    const top = proposals.proposals.slice(0, Number($("emulate-button").dataset.top) || EMULATE_TOP);
    const job = getJob();
    const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const gpuType = $("emulate-gpu").value;
    const response = await fetch("/api/emulations", {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json", "X-CSRFToken": token },
      body: JSON.stringify({ configs: top.map((p) => ({ model: job.model, layout: p.layout, gpus: p.world,
        gpu_type: gpuType, global_batch: job.global_batch, micro_batch: job.micro_batch, seq_len: job.seq_len })) }),
    });
    const body = await response.json().catch(() => null);
    if (response.status !== 201) { showError(`Emulation refused: ${describeError(body, response.status)}`); return; }
    const mine = proposals;
    body.runs.forEach((run) => { runs[run.layout] = run; });
    const update = () => {
      if (mine !== proposals) return; // a newer GPU count was asked for
      const done = Object.values(runs).filter((r) => r.state === "done" || r.state === "failed").length;
      const all = Object.keys(runs).length;
      $("emulate-status").textContent = done < all ? `emulating on the agents: ${done} of ${all} done…`
        : `Ranked by the emulator (${gpuType}) for the top ${all}: fits in memory first (emulated peak incl. ` +
          "activations), then the emulated step time; the rest by rule.";
      $("proposals-section").dataset.emulated = String(done === all);
      renderProposals(rankByEmulation(proposals.proposals, runs, proposals.capacity_bytes));
      return done === all;
    };
    update();
    while (!update()) {
      await new Promise((resolve) => setTimeout(resolve, 1000));
      await Promise.all(Object.values(runs).filter((r) => r.state !== "done" && r.state !== "failed").map(async (r) => {
        const reply = await fetch(`/api/emulations/${r.id}`, { credentials: "same-origin" });
        if (reply.ok) runs[r.layout] = await reply.json();
      }));
    }
  });

  async function preview(layout) {
    showError("");
    const response = await fetch(`/jobs/${getJob().id}/plan-figures.json?layout=${encodeURIComponent(layout)}`,
      { credentials: "same-origin" });
    const body = await response.json().catch(() => null);
    if (!response.ok) { showError(describeError(body, response.status)); return; }
    chosen = layout;
    const s = body.summary;
    $("plan-title").textContent = `Plan: ${s.src} → ${s.dst}`;
    fillDl($("plan-summary"), [["network bytes", mib(s.network_bytes)], ["kept locally", mib(s.local_bytes)],
      ["rounds", s.rounds], ["transfers", s.transfers], ["predicted peak per rank", mib(s.predicted_peak_bytes)],
      ["estimated transfer time", secs(s.estimated_seconds)], ["plan fingerprint", s.fingerprint.slice(0, 12)]]);
    $("plan-section").hidden = false;
    $("plan-section").dataset.layout = layout;
    for (const [key, id] of [["heatmap", "plan-heatmap"], ["rounds", "plan-rounds"], ["wave", "plan-wave"]]) {
      draw(id, body[key]);
    }
    $("resize-open").textContent = `Resize to ${layout}…`;
    $("resize-open").focus();
  }

  $("resize-open").addEventListener("click", () => {
    const job = getJob();
    if (!chosen || !states.resize.includes(getState())) return;
    $("resize-dialog-text").textContent =
      `Switch ${job.name} from ${job.layout} (${job.world_size} GPUs) to ${chosen} while it trains? ` +
      "Training pauses at a step boundary while the state moves; the new layout is verified before it commits.";
    $("resize-dialog").showModal();
  });
  $("resize-cancel").addEventListener("click", () => $("resize-dialog").close());
  $("resize-confirm").addEventListener("click", async () => {
    $("resize-dialog").close();
    showError("");
    const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch(`/api/jobs/${getJob().id}/resize`, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": token }, body: JSON.stringify({ layout: chosen }),
    });
    const body = await response.json().catch(() => null);
    if (response.status !== 202) { showError(`Resize refused: ${describeError(body, response.status)}`); return; }
    follow(body.id);
    showProgress(getLive().transitions.find((t) => t.id === body.id) || { ...body, verified: null });
  });

  function follow(id) {
    tracking = id;
    waveShown = null;
    $("progress-section").hidden = false;
    $("progress-round").textContent = "";
    $("progress-wave-figure").hidden = true;
    $("resize-result").replaceChildren();
    $("progress-section").focus();
  }

  // The measured memory waves over the predicted ones: the figure is built on the server
  // (GET /transitions/<id>/wave.json); fetched again only when the transfer got further or
  // the state changed (rank 0 sends at most two progress reports a second).
  let waveShown = null;
  let waveLoading = false;
  async function drawWave(t) {
    const key = `${t.id}:${t.state}:${t.progress ? t.progress.round : -1}:${Object.keys(t.progress?.waves || {}).length}`;
    const moving = STEPS.indexOf(t.state) >= STEPS.indexOf("transferring") || TERMINAL.includes(t.state);
    if (waveShown === key || waveLoading || t.kind === "restore" || !moving) return;
    waveLoading = true;
    try {
      const response = await fetch(`/transitions/${t.id}/wave.json`, { credentials: "same-origin" });
      if (!response.ok || tracking !== t.id) return;
      const body = await response.json();
      waveShown = key;
      $("progress-wave-figure").hidden = false;
      draw("progress-wave", body.wave);
    } finally {
      waveLoading = false;
    }
    const latest = getLive().transitions.find((x) => x.id === tracking);
    if (latest) drawWave(latest); // a report that came while this one loaded
  }

  function showProgress(t) {
    const section = $("progress-section");
    section.dataset.state = t.state;
    section.dataset.transition = String(t.id);
    const reached = STEPS.indexOf(t.state);
    for (const li of $("progress-steps").children) {
      const i = STEPS.indexOf(li.dataset.step);
      li.dataset.done = String(reached >= 0 && i <= reached);
      li.dataset.current = String(i === reached);
    }
    const rounds = t.rounds ? ` · ${t.rounds} round${t.rounds === 1 ? "" : "s"}` : "";
    $("progress-text").textContent = TERMINAL.includes(t.state)
      ? `${t.source_layout} → ${t.destination_layout}: ${t.state}${rounds}`
      : `${t.source_layout} → ${t.destination_layout}: ${t.state}…${rounds}`;
    const p = t.progress;
    if (p && p.rounds) {
      $("progress-round").textContent = `round ${p.round} of ${p.rounds} · ${mib(p.moved_bytes)} moved`
        + (t.network_bytes ? ` of ${mib(t.network_bytes)}` : "");
      $("progress-round").dataset.round = String(p.round);
      $("progress-round").dataset.rounds = String(p.rounds);
    }
    drawWave(t);
    fillDl($("progress-timings"), [["preparation (training goes on)", secs(t.prepare_seconds)],
      ["pause", secs(t.pause_seconds)], ["transfer", secs(t.transfer_seconds)], ["verification", secs(t.verify_seconds)],
      ["network bytes", t.network_bytes === null ? "–" : mib(t.network_bytes)],
      ["peak bytes rank 0 (measured / predicted)",
        `${t.peak_bytes ? mib(t.peak_bytes) : "–"} / ${t.predicted_peak_bytes ? mib(t.predicted_peak_bytes) : "–"}`]]);
    if (TERMINAL.includes(t.state)) showResult(t);
  }

  function showResult(t) {
    const result = $("resize-result");
    result.dataset.state = t.state;
    if (t.state !== "committed") {
      result.replaceChildren(el("p", { class: "error", role: "alert" },
        `The switch ${t.state.replace("_", " ")}: ${t.reason}. The job keeps training on ${t.source_layout}.`));
      return;
    }
    const [before, after] = stepTimeAround(getLive().metrics.step_seconds, t.step);
    const link = el("a", { href: `/transitions/${t.id}/` }, "transition details");
    const p = el("p", { role: "status" });
    p.append(`Committed at step ${t.step}: ${t.verified ? "every tensor verified bit-exact" : "NOT verified"}, ` +
      `pause ${secs(t.pause_seconds)}, step time ${secs(before)} before → ${after === null ? "measuring…" : secs(after)} after. `, link);
    result.replaceChildren(p);
    result.dataset.verified = String(Boolean(t.verified));
  }

  onEvent((event, live) => {
    if (event.type === "transition" && tracking === null && !TERMINAL.includes(event.transition.state)) {
      follow(event.transition.id); // started elsewhere (API, another tab)
    }
    if (event.type === "transition" && event.transition.state === "committed") {
      refetchDue = true; // (asked again once the page has read the job's new layout and state)
      update();
    }
    const t = live.transitions.find((x) => x.id === tracking);
    if (t) showProgress(t);
  });

  const active = getLive().transitions.find((t) => !TERMINAL.includes(t.state));
  if (active) { follow(active.id); showProgress(active); }
  input.value = getJob().world_size;
  update();
  return { update };
}
