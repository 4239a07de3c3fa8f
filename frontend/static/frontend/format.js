// The one formatter every page uses for what it shows: durations, bytes (binary units
// throughout), counts and rates, percentages and times (relative, the local time on hover).
// Never scientific notation: a number is rounded to 3 significant digits in decimal form
// and moved to the next unit when rounding reaches it (999.6 ms -> "1.00 s", not "1.00e+3 ms").
// Pure, no DOM except `liveTimes`; frontend/formatting.py is its Python twin for the
// templates and the figures, and tests/test_format_js.py checks they agree.

export const DASH = "–";
const missing = (x) => x === null || x === undefined || Number.isNaN(x);

// Decimal digits that leave `digits` significant ones for |x| (0 for |x| >= 10^(digits-1)).
function decimalsFor(x, digits) {
  if (x === 0) return digits - 1;
  // The exponent of the shortest decimal form (exact, unlike Math.log10 near powers of ten).
  const exponent = Number(x.toExponential().split("e")[1]);
  return Math.max(0, digits - 1 - exponent);
}

// x with `digits` significant digits, as decimals (no exponent), e.g. 0.000588 -> "0.000588";
// below 1e-15, "0".
export function sig(x, digits = 3) {
  if (missing(x)) return DASH;
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "-∞";
  if (Math.abs(x) < 1e-15) return "0"; // below any reading: 0 (and toFixed takes at most 100 places)
  if (Math.abs(x) >= 1e21) { // toFixed would use an exponent here: spell the zeros out
    const [mantissa, exponent] = x.toPrecision(digits).split("e+");
    return (x < 0 ? "-" : "") + mantissa.replace(/[-.]/g, "") + "0".repeat(Number(exponent) - digits + 1);
  }
  let text = x.toFixed(decimalsFor(x, digits));
  // Rounding may add a digit (9.996 -> "10.00"): one decimal fewer then.
  const rounded = Number(text);
  if (rounded !== 0 && decimalsFor(rounded, digits) < decimalsFor(x, digits)) text = x.toFixed(decimalsFor(rounded, digits));
  return text === "-0" || /^-0\.0*$/.test(text) ? text.slice(1) : text;
}

// Whole numbers with thousands separators (12345 -> "12,345").
export function integer(n) {
  if (missing(n)) return DASH;
  let text = Math.abs(n) >= 1e21 ? BigInt(n).toString() : n.toFixed(0);
  if (text === "-0") text = "0";
  const negative = text.startsWith("-");
  const digits = negative ? text.slice(1) : text;
  return (negative ? "-" : "") + digits.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

// Scale |x| into one of `units` ([divisor, suffix], ascending): the largest unit whose
// divisor it reaches once rounded to 3 significant digits.
function scaled(x, units, digits = 3) {
  let pick = units[0];
  for (const unit of units) {
    if (Math.abs(Number(sig(x / unit[0], digits))) >= 1) pick = unit;
  }
  return `${sig(x / pick[0], digits)} ${pick[1]}`;
}

const SUB_SECOND = [[1e-9, "ns"], [1e-6, "µs"], [1e-3, "ms"], [1, "s"]];

// Seconds as ns/µs/ms/s below a minute, then "3 min 05 s", "2 h 05 min", "3 d 04 h".
export function duration(seconds) {
  if (missing(seconds)) return DASH;
  if (!Number.isFinite(seconds)) return seconds > 0 ? "∞" : "-∞";
  if (seconds < 0) return `-${duration(-seconds)}`;
  if (seconds === 0) return "0 s";
  if (Number(sig(seconds)) < 60) return scaled(seconds, SUB_SECOND);
  const whole = Number(seconds.toFixed(0));
  const pad = (n) => String(n).padStart(2, "0");
  if (whole < 3600) return `${Math.floor(whole / 60)} min ${pad(whole % 60)} s`;
  const minutes = Number((seconds / 60).toFixed(0));
  if (minutes < 24 * 60) return `${Math.floor(minutes / 60)} h ${pad(minutes % 60)} min`;
  const hours = Number((seconds / 3600).toFixed(0));
  return `${integer(Math.floor(hours / 24))} d ${pad(hours % 24)} h`;
}

export const BINARY = [[1, "B"], [2 ** 10, "KiB"], [2 ** 20, "MiB"], [2 ** 30, "GiB"], [2 ** 40, "TiB"],
  [2 ** 50, "PiB"], [2 ** 60, "EiB"]];

// Bytes in binary units: "512 B", "1.50 KiB", "80.0 GiB".
export function bytes(n) {
  if (missing(n)) return DASH;
  if (Math.abs(n) < 1024) return `${integer(n)} B`;
  return scaled(n, BINARY);
}

const SI = [[1, ""], [1e3, "k"], [1e6, "M"], [1e9, "G"], [1e12, "T"], [1e15, "P"], [1e18, "E"]];

// A count with an SI prefix: "588", "12.3 k", "4.56 M" (decimal: these are not bytes).
export function count(x) {
  if (missing(x)) return DASH;
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "-∞";
  return scaled(x, SI).trimEnd();
}

// Per-second rates: rate(12345, "tokens") -> "12.3 k tokens/s"; byteRate -> "1.50 GiB/s".
export function rate(perSecond, what) {
  if (missing(perSecond)) return DASH;
  return `${count(perSecond)} ${what}/s`;
}

export function byteRate(bytesPerSecond) {
  if (missing(bytesPerSecond)) return DASH;
  return `${bytes(bytesPerSecond)}/s`;
}

// A fraction as a percentage: 0.4534 -> "45.3 %".
export function percent(fraction) {
  if (missing(fraction)) return DASH;
  return `${sig(fraction * 100)} %`;
}

// A node's host as its agent last showed it: "CPU 45.3 % of 16 · mem 3.00 GiB / 16.0 GiB";
// "" before its first report with host stats (the cluster page and the job page's grid).
export function hostStats(cpuPercent, cpuCount, memoryUsedBytes, memoryTotalBytes) {
  if (missing(cpuPercent)) return "";
  return `CPU ${percent(cpuPercent / 100)} of ${cpuCount === null || cpuCount === undefined ? DASH : cpuCount} · mem ` +
    `${bytes(memoryUsedBytes)} / ${bytes(memoryTotalBytes)}`;
}

export const hostText = (node) => hostStats(node.cpu_percent, node.cpu_count, node.memory_used_bytes,
  node.memory_total_bytes);

// Seconds between then and now as words: "just now", "42 s ago", "3 min ago", "5 h ago",
// "2 d ago"; "in 3 min" for the future.
export function relativeSeconds(seconds) {
  if (missing(seconds)) return DASH;
  const ahead = seconds < 0;
  const s = Math.abs(seconds);
  let text;
  if (s < 10) return "just now";
  if (s < 60) text = `${Math.floor(s)} s`;
  else if (s < 3600) text = `${Math.floor(s / 60)} min`;
  else if (s < 86400) text = `${Math.floor(s / 3600)} h`;
  else text = `${Math.floor(s / 86400)} d`;
  return ahead ? `in ${text}` : `${text} ago`;
}

// An ISO time (or Date) relative to now, and its local time for the hover title.
export function relativeTime(iso, now = Date.now()) {
  if (missing(iso) || iso === "") return DASH;
  const then = iso instanceof Date ? iso.getTime() : Date.parse(iso);
  if (Number.isNaN(then)) return DASH;
  return relativeSeconds((now - then) / 1000);
}

export function localTime(iso) {
  const then = iso instanceof Date ? iso : new Date(iso);
  if (Number.isNaN(then.getTime())) return "";
  return then.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit",
    minute: "2-digit", second: "2-digit" });
}

// A <time> element: relative text, the local time on hover, kept fresh by liveTimes().
export function timeElement(iso, now = Date.now()) {
  const node = document.createElement("time");
  node.dateTime = iso;
  node.dataset.relative = "";
  node.textContent = relativeTime(iso, now);
  node.title = localTime(iso);
  return node;
}

// Every <time data-relative> on the page: the relative text now, the browser's local time
// as its title (the server rendered it in UTC); again every 30 s.
export function liveTimes(root = document) {
  const refresh = () => {
    for (const node of root.querySelectorAll("time[data-relative]")) {
      node.textContent = relativeTime(node.dateTime);
      node.title = localTime(node.dateTime);
    }
  };
  refresh();
  return setInterval(refresh, 30_000);
}
