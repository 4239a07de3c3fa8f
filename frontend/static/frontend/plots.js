// Drawing the server's Plotly figures (frontend/figures.py) so that they follow the window.
//
// Plotly's responsive mode resizes a chart to its div's computed size on every window
// resize. The figures fix their height, but the div's own height was only what the last
// draw left in it, so each resize fed a different height back (the charts grew out of
// their cards, or shrank, at the next width). Pinning the div to the figure's height
// leaves responsive mode only the width to follow: the card's.
export const PLOT_CONFIG = { displayModeBar: false, responsive: true };

//
// A legend below the plot (legend.yref "container") wraps into more rows on a narrow
// screen; the figure grows by those rows so that the plot keeps its height.
export function legendRows(figure, widthPx) {
  const legend = figure.layout && figure.layout.legend;
  if (!legend || legend.yref !== "container" || figure.layout.showlegend === false) return 1;
  const entries = figure.data.filter((t) => t.showlegend !== false && t.name).length;
  return Math.max(1, Math.ceil(entries / Math.max(1, Math.floor(widthPx / 150))));
}

export function draw(target, figure) {
  const el = typeof target === "string" ? document.getElementById(target) : target;
  let layout = figure.layout;
  if (layout && layout.height) {
    const extra = 20 * (legendRows(figure, el.clientWidth || 600) - legendRows(figure, 1400));
    if (extra > 0) layout = { ...layout, height: layout.height + extra };
    el.style.height = `${layout.height}px`;
  }
  return window.Plotly.react(el, figure.data, layout, PLOT_CONFIG);
}
