// The jobs list's view: which rows show (state filter, search by name or model) and in
// which order (a column, either way), and the address that shares it (?sort=&dir=&state=&q=;
// frontend/jobs_query.py checks it on the server). Pure: rows are plain objects
// {id, name, model, layout, gpus, state, step, loss, switches, elastic, priority, created (ms
// since 1970)}, where elastic is a list of numbers compared in order (elastic-view.js
// elasticSortKey); tests/test_dashboard_views_js.py runs it under node against a Python oracle.

export const DEFAULT_VIEW = { sort: "created", dir: "desc", state: "", q: "" };
const TEXT = new Set(["name", "model", "layout", "state"]);
const collator = new Intl.Collator("en", { numeric: true, sensitivity: "base" });

// Whether a row shows: its state is the filter's (`active`: any live state) and the search's
// words all appear in its name or model (case ignored).
export function matches(row, view, liveStates) {
  if (view.state === "active" ? !liveStates.includes(row.state) : view.state && row.state !== view.state) return false;
  const words = view.q.toLowerCase().split(/\s+/).filter(Boolean);
  const text = `${row.name} ${row.model}`.toLowerCase();
  return words.every((w) => text.includes(w));
}

// Lists of numbers in order: the first that differs decides.
function compareLists(x, y) {
  for (let i = 0; i < Math.min(x.length, y.length); i += 1) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

// Order of two rows under the view: by the column (words in natural order, "job-2" before
// "job-10"; numbers by value), missing values last whichever the direction, then newest first.
export function compareRows(a, b, view) {
  const [x, y] = [a[view.sort], b[view.sort]];
  const missingX = x === null || x === undefined;
  const missingY = y === null || y === undefined;
  if (missingX !== missingY) return missingX ? 1 : -1;
  if (!missingX) {
    const order = TEXT.has(view.sort) ? collator.compare(String(x), String(y))
      : Array.isArray(x) ? compareLists(x, y) : x - y;
    if (order !== 0) return view.dir === "asc" ? order : -order;
  }
  return b.id - a.id;
}

export function arrange(rows, view, liveStates) {
  return rows.filter((row) => matches(row, view, liveStates)).sort((a, b) => compareRows(a, b, view));
}

// The view after a click on a column's header: the other direction on the sorted column,
// else that column in its first direction (`firstDir`: column -> "asc" | "desc").
export function clickSort(view, column, firstDir) {
  if (view.sort === column) return { ...view, dir: view.dir === "asc" ? "desc" : "asc" };
  return { ...view, sort: column, dir: firstDir[column] || "asc" };
}

// The address's query for a view: only what differs from the default ("" for the default).
export function toQuery(view) {
  const params = new URLSearchParams();
  if (view.sort !== DEFAULT_VIEW.sort || view.dir !== DEFAULT_VIEW.dir) {
    params.set("sort", view.sort);
    params.set("dir", view.dir);
  }
  if (view.state) params.set("state", view.state);
  if (view.q) params.set("q", view.q);
  const text = params.toString();
  return text ? `?${text}` : "";
}
