// Transition page: draw the plan's figures (built on the server by frontend/figures.py).
const figures = JSON.parse(document.getElementById("plan-figures").textContent);
for (const [key, id] of [["heatmap", "plan-heatmap"], ["rounds", "plan-rounds"], ["wave", "plan-wave"]]) {
  window.Plotly.react(id, figures[key].data, figures[key].layout, { displayModeBar: false, responsive: true });
}
