// The job page's training charts as pure functions of its live snapshot: the layout
// history as bands with a marker (dashed line + label) at each switch, labels in rows that
// never overlap (mirrors frontend/figures.py: band_shapes), "no data yet" before the first
// step, optional smoothing and a time axis. The page only hands the result to Plotly.react.
// tests/test_job_store_js.py runs these under node against the Python figures.
import { historyBands } from "./job-store.js";
import { duration } from "./format.js";

export const LABEL_ROWS = 3;
export const LABEL_ROW_PX = 14;
export const CHAR_PX = 6.6;
export const CHART_PX = 600;
const BAND_COLORS = ["#2f6fd6", "#d79a1c"];

export const bandLabel = (band) => (band.transition === null || band.transition === undefined
  ? band.layout : `#${band.transition} → ${band.layout}`);

export function bandLabelRows(bands, plotPx = CHART_PX) {
  if (!bands.length) return [];
  const lo = Math.min(...bands.map((b) => b.x0));
  const hi = Math.max(...bands.map((b) => b.x1));
  const perPx = (hi - lo || 1) / Math.max(plotPx, 1);
  const ends = [];
  return bands.map((band) => {
    const width = ([...bandLabel(band)].length * CHAR_PX + 8) * perPx;
    let row = ends.findIndex((end) => end <= band.x0);
    if (row === -1) row = null;
    if (row === null && ends.length < LABEL_ROWS) { row = ends.length; ends.push(0); }
    if (row !== null) ends[row] = band.x0 + width;
    return row;
  });
}

export function bandShapes(bands, plotPx = CHART_PX) {
  const shapes = [];
  const notes = [];
  const rows = bandLabelRows(bands, plotPx);
  bands.forEach((band, i) => {
    const color = BAND_COLORS[i % BAND_COLORS.length];
    shapes.push({ type: "rect", xref: "x", yref: "paper", x0: band.x0, x1: band.x1, y0: 0, y1: 1, fillcolor: color,
      opacity: 0.08, line: { width: 0 }, layer: "below" });
    if (band.transition !== null && band.transition !== undefined) {
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: band.x0, x1: band.x0, y0: 0, y1: 1,
        line: { color: "#1d2330", width: 1, dash: "dash" }, name: `switch ${band.transition}` });
    }
    if (rows[i] !== null) {
      notes.push({ xref: "x", yref: "paper", x: band.x0, y: 1, xanchor: "left", yanchor: "bottom",
        yshift: rows[i] * LABEL_ROW_PX, text: bandLabel(band), showarrow: false, font: { size: 11, color } });
    }
  });
  return [shapes, notes];
}

export const topMargin = (notes) => 10 + LABEL_ROW_PX * Math.max(0, ...notes.map((n) => Math.round((n.yshift || 0) / LABEL_ROW_PX) + 1));

// TensorBoard's debiased exponential moving average: weight 0 leaves the values as they are.
export function smooth(ys, weight) {
  if (!(weight > 0)) return [...ys];
  let last = 0;
  return ys.map((y, i) => {
    last = last * weight + (1 - weight) * y;
    return last / (1 - weight ** (i + 1));
  });
}

// Seconds since the first step at each x: the step times up to that step plus the pauses of
// the switches committed before it (the training's own clock; metrics carry no timestamps).
export function elapsedSeconds(stepSeries, transitions, xs) {
  const points = (stepSeries ? stepSeries.x.map((x, i) => [x, stepSeries.y[i]]) : []).sort((a, b) => a[0] - b[0]);
  const pauses = transitions.filter((t) => t.state === "committed" && t.step !== null && t.step !== undefined)
    .map((t) => [t.step, t.pause_seconds || 0]);
  return xs.map((x) => points.filter(([sx]) => sx <= x).reduce((sum, [, y]) => sum + y, 0)
    + pauses.filter(([step]) => step < x).reduce((sum, [, p]) => sum + p, 0));
}

const lastX = (series) => (series && series.x.length ? series.x[series.x.length - 1] : 0);

// The validation loss as the loss chart's second trace: one line across every resize (mirrors
// frontend/figures.py: validation_trace). `toX` maps steps to the x axis, `time` says which.
export const VALIDATION = { name: "validation", mode: "lines+markers", line: { width: 1.5, color: "#d62728" },
  marker: { size: 5, color: "#d62728" } };
export function validationTrace(series, toX = (xs) => [...xs], time = false) {
  return { type: "scatter", ...VALIDATION, x: toX(series.x), y: [...series.y], customdata: series.x,
    hovertemplate: time ? "step %{customdata}, %{x:,.4~r} s, validation: %{y:,.4~r}<extra></extra>"
      : "step %{x}, validation: %{y:,.4~r}<extra></extra>" };
}
const LEGEND_BELOW = { orientation: "h", yref: "container", y: 0, yanchor: "bottom", x: 0 }; // figure_style.legend_below

// The figure of one metric from the page's base figure (frontend/figures.py: metric_figure)
// and the live snapshot; the loss chart with the validation loss as a second trace (not
// smoothed). opts: {plotPx, smoothing (0..1), axis: "step" | "time"}.
export function metricFigure(base, name, live, layout, opts = {}) {
  const series = live.metrics[name] || { x: [], y: [] };
  const plotPx = opts.plotPx || CHART_PX;
  const last = Math.max(0, ...Object.values(live.metrics).map(lastX));
  const bands = historyBands(layout, live.transitions, last);
  const time = opts.axis === "time";
  const toX = time ? (xs) => elapsedSeconds(live.metrics.step_seconds, live.transitions, xs) : (xs) => [...xs];
  let [shapes, notes] = bandShapes(bands, plotPx);
  if (time) { // the bands and markers move onto the time axis with the data
    const edges = toX(bands.flatMap((b) => [b.x0, b.x1]));
    const timed = bands.map((b, i) => ({ ...b, x0: edges[2 * i], x1: edges[2 * i + 1] }));
    [shapes, notes] = bandShapes(timed, plotPx);
  }
  const trace = { ...base.data[0], x: toX(series.x), y: [...series.y], customdata: series.x,
    hovertemplate: time ? "step %{customdata}, %{x:,.4~r} s: %{y:,.4~r}<extra></extra>"
      : "step %{x}: %{y:,.4~r}<extra></extra>" };
  const data = [trace];
  if (opts.smoothing > 0 && series.y.length) {
    trace.opacity = 0.3;
    trace.hoverinfo = "skip";
    delete trace.hovertemplate;
    data.push({ type: "scatter", mode: "lines", name: `${name} (smoothed)`, x: trace.x, y: smooth(series.y, opts.smoothing),
      customdata: series.x, line: { width: 2, color: "#1f77b4" },
      hovertemplate: `step %{customdata}, smoothed ${opts.smoothing}: %{y:,.4~r}<extra></extra>` });
  }
  const validation = name === "loss" ? live.metrics.validation_loss : null;
  const layoutOut = { ...base.layout, shapes, annotations: notes, margin: { ...base.layout.margin, t: topMargin(notes) },
    xaxis: { ...base.layout.xaxis, visible: true, title: { text: time ? "time since the first step (s)" : "step" } },
    yaxis: { ...base.layout.yaxis, visible: true } };
  if (validation && validation.x.length) {
    data.push(validationTrace(validation, toX, time));
    Object.assign(layoutOut, { showlegend: true, legend: LEGEND_BELOW });
  }
  if (!series.x.length) {
    return { data, layout: { ...layoutOut, shapes: [], xaxis: { ...layoutOut.xaxis, visible: false },
      yaxis: { ...layoutOut.yaxis, visible: false }, annotations: [{ text: "no data yet", xref: "paper", yref: "paper",
        x: 0.5, y: 0.5, showarrow: false, font: { size: 14, color: "#667" }, name: "no-data" }] } };
  }
  return { data, layout: layoutOut, bands: bands.length, lastTime: time ? duration(trace.x.at(-1)) : null };
}
