// Rank 0's log on the job page: which lines are errors or warnings (pure: classifyLines,
// tested under node by tests/test_log_view_js.py) and the panel that shows them, replaced
// whole by each `log` event of /ws/jobs/<id>/ (the agent sends the tail when it changes).
import { relativeTime } from "./format.js";

const ERROR = /(^Traceback \(most recent call last\))|(^\[E\d{4} )|\b(\w*Error|\w*Exception|FATAL|CRITICAL|Killed|exited with code [1-9]\d*)\b/;
const WARNING = /(^\[W\d{4} )|\b(\w*Warning|WARNING|warning:)/;

// [{text, level}] with level "error", "warning" or "info". A traceback is an error from its
// first line to its last (the exception line, the first one not indented after it).
export function classifyLines(lines) {
  let inTraceback = false;
  return lines.map((text) => {
    if (/^Traceback \(most recent call last\)/.test(text)) { inTraceback = true; return { text, level: "error" }; }
    if (inTraceback) {
      if (!/^\s/.test(text)) inTraceback = false; // the exception line ends it
      return { text, level: "error" };
    }
    if (ERROR.test(text)) return { text, level: "error" };
    if (WARNING.test(text)) return { text, level: "warning" };
    return { text, level: "info" };
  });
}

const $ = (id) => document.getElementById(id);

export function startLogPanel(initial) {
  let log = initial;
  const only = $("log-errors-only");

  function draw() {
    const classified = classifyLines(log.lines);
    const shown = only.checked ? classified.filter((l) => l.level !== "info") : classified;
    const box = $("job-log");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 8;
    box.replaceChildren(...shown.map(({ text, level }) => {
      const line = document.createElement("span");
      line.className = `log-line log-${level}`;
      line.dataset.level = level;
      line.textContent = text + "\n";
      return line;
    }));
    if (atBottom) box.scrollTop = box.scrollHeight; // follow the newest lines unless scrolled up
    const errors = classified.filter((l) => l.level === "error").length;
    box.dataset.lines = String(log.lines.length);
    box.dataset.errors = String(errors);
    box.dataset.finished = String(log.finished);
    const empty = !log.lines.length ? "No lines yet: rank 0's output shows here once the job has started."
      : !shown.length ? "No errors or warnings in these lines." : "";
    $("job-log-empty").hidden = !empty;
    $("job-log-empty").textContent = empty;
    const parts = [];
    if (log.lines.length) parts.push(`${log.lines.length} line${log.lines.length === 1 ? "" : "s"}`);
    if (errors) parts.push(`${errors} error line${errors === 1 ? "" : "s"}`);
    if (log.truncated) parts.push("earlier lines not shown");
    if (log.node) parts.push(`rank ${log.rank} on ${log.node}`);
    if (log.sent_at) parts.push(`read ${relativeTime(log.sent_at)}`);
    if (log.finished) parts.push("rank 0 has exited: its last lines");
    $("job-log-status").textContent = parts.join(" · ");
  }

  only.addEventListener("change", draw);
  draw();
  return {
    replace(next) { log = next; draw(); },
    refresh: draw, // (the relative time)
  };
}
