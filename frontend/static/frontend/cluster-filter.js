// The cluster page's node filter in the address (?state=&job=&node=), so that a link opens the
// page listing and outlining what its sender saw. Pure; tests/test_cluster_filter_js.py runs it
// under node.

export const NO_FILTER = { state: "", job: "", name: "" };
const LONGEST = 100; // (a job or node name is at most 63 characters: more is not a name)

// The filter an address asks for: a state the page does not know, or a job that holds no GPUs
// (`jobs`: the names of the jobs that do), is left out rather than listing nothing.
export function filterFromQuery(search, states, jobs) {
  const params = new URLSearchParams(search);
  const state = params.get("state") || "";
  const job = (params.get("job") || "").slice(0, LONGEST);
  return {
    state: states.includes(state) ? state : "",
    job: jobs.has(job) ? job : "",
    name: (params.get("node") || "").slice(0, LONGEST),
  };
}

// The address's query for a filter: only what is set ("" when nothing is).
export function filterToQuery(filter) {
  const params = new URLSearchParams();
  if (filter.state) params.set("state", filter.state);
  if (filter.job) params.set("job", filter.job);
  if (filter.name) params.set("node", filter.name);
  const text = params.toString();
  return text ? `?${text}` : "";
}
