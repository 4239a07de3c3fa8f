// Transition page: draw the plan's figures (built on the server by frontend/figures.py) and
// filter the per-tensor verification table by name.
import { draw } from "./plots.js";
import { liveTimes } from "./format.js";

liveTimes();

const figures = JSON.parse(document.getElementById("plan-figures")?.textContent || "null");
for (const [key, id] of [["heatmap", "plan-heatmap"], ["rounds", "plan-rounds"], ["wave", "plan-wave"]]) {
  if (figures) draw(id, figures[key]);
}

const filter = document.getElementById("tensor-filter");
if (filter) {
  const rows = [...document.querySelectorAll("#tensor-rows tr")];
  const apply = () => {
    const needle = filter.value.trim().toLowerCase();
    let shown = 0;
    for (const row of rows) {
      row.hidden = needle !== "" && !row.dataset.name.toLowerCase().includes(needle);
      if (!row.hidden) shown += 1;
    }
    document.getElementById("tensor-count").textContent = `${shown} of ${rows.length} shown`;
  };
  filter.addEventListener("input", apply);
  apply();
}
