// Drawing the server's Plotly figures (frontend/figures.py) so that they follow the window.
//
// Plotly's responsive mode resizes a chart to its div's computed size on every window
// resize. The figures fix their height, but the div's own height was only what the last
// draw left in it, so each resize fed a different height back (the charts grew out of
// their cards, or shrank, at the next width). Pinning the div to the figure's height
// leaves responsive mode only the width to follow: the card's.
export const PLOT_CONFIG = { displayModeBar: false, responsive: true };

export function draw(target, figure) {
  const el = typeof target === "string" ? document.getElementById(target) : target;
  if (figure.layout && figure.layout.height) el.style.height = `${figure.layout.height}px`;
  return window.Plotly.react(el, figure.data, figure.layout, PLOT_CONFIG);
}
