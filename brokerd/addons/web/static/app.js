// The vaccel dashboard: plain JavaScript, no build step, nothing loaded from elsewhere.
// It draws what the daemon pushes on /events (the `vaccel status --json` data) and what
// /api/timeline and /api/report return. Every piece of text from the daemon goes in as
// textContent: user names and commands come from other users' processes.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = { status: null, statusAt: 0, timeline: null, report: null, reportNote: "", reportBy: "user" };

// -- small helpers ----------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key === "data") Object.assign(node.dataset, value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function duration(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return `${seconds}s`;
  const m = Math.floor(seconds / 60), h = Math.floor(m / 60), d = Math.floor(h / 24);
  if (d) return `${d}d ${h % 24}h`;
  if (h) return `${h}h ${m % 60}m`;
  return `${m}m ${seconds % 60}s`;
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hour12: false });
}

function mib(value) {
  return value >= 1024 ? `${(value / 1024).toFixed(value % 1024 ? 1 : 0)} GiB` : `${value} MiB`;
}

function hours(value) {
  if (value < 1 / 60) return value > 0 ? "< 1 min" : "0";
  return value < 1 ? `${Math.round(value * 60)} min` : `${value.toFixed(1)} h`;
}

// Each user a colour of their own, far from the ones before (golden-angle hues), the
// same in every chart of this page.
const palette = new Map();
function color(name) {
  if (!palette.has(name)) palette.set(name, palette.size);
  return `hsl(${(palette.get(name) * 137.508 + 210) % 360}, 60%, 50%)`;
}

function now() { return Date.now() / 1000; }

function rowLabel(key) {
  // Report rows by device are keyed by uuid: show the index `vaccel status` shows.
  const device = state.status && state.status.devices.find((d) => d.uuid === key);
  return device ? name(device) : key;
}

// How `vaccel status` names a device: gpu0, or gpu0.1 for a MIG instance.
function name(d) { return d.label || `gpu${d.index}`; }

// The timeline zooms to the history there is, up to its 24 hours: [window, tick step] in s.
const ZOOMS = [[120, 30], [300, 60], [600, 120], [1800, 300], [3600, 600], [3 * 3600, 1800], [6 * 3600, 3600], [12 * 3600, 2 * 3600],
  [24 * 3600, 3 * 3600]];
const ZOOM_NAMES = { 120: "2 minutes", 300: "5 minutes", 600: "10 minutes", 1800: "30 minutes", 3600: "hour", 10800: "3 hours", 21600: "6 hours",
  43200: "12 hours", 86400: "24 hours" };

function table(header, rows, numeric = []) {
  const head = el("tr", {}, header.map((h, i) => el("th", numeric.includes(i) ? { class: "num" } : {}, h)));
  const body = rows.map((row) => el("tr", {}, row.map((cell, i) => {
    if (header[i] === "command") {  // long paths: the start here, all of it on hover
      const text = String(cell);
      return el("td", { class: "cmd", title: text }, text.length > 72 ? `${text.slice(0, 71)}…` : text);
    }
    return el("td", numeric.includes(i) ? { class: "num" } : {}, cell);
  })));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, body));
}

function fill(id, ...children) { document.getElementById(id).replaceChildren(...children.flat()); }

// -- the status: devices, queue, unleased use -------------------------------------------

function renderStatus() {
  const s = state.status;
  if (!s) return;
  document.getElementById("host").textContent = s.hostname + (s.simulated ? " (simulated devices)" : "");
  const leased = s.devices.filter((d) => d.state === "leased").length;
  document.getElementById("summary").textContent =
    `${leased}/${s.devices.length} devices leased · ${s.queue.length} waiting · ` +
    `${s.unleased_processes.length} unleased GPU process${s.unleased_processes.length === 1 ? "" : "es"}`;
  const byUuid = Object.fromEntries(s.devices.map((d) => [d.uuid, d]));
  fill("devices", s.devices.map(deviceCard));
  fill("queue", s.queue.length ? table(
    ["#", "user", "pid", "wants", "waiting", "why", "command"],
    s.queue.map((q) => [q.position, q.requester.user || q.requester.uid, q.requester.pid,
      (q.memory_mib ? `a ${mib(q.memory_mib)} share` : `${q.gpus} device${q.gpus > 1 ? "s" : ""}`) +
        (q.min_memory_mib ? `, ≥ ${mib(q.min_memory_mib)}` : ""),
      duration(now() - q.since), q.reason || "", q.requester.command]), [0, 2, 4])
    : el("p", { class: "empty" }, "nobody is waiting"));
  fill("unleased", s.unleased_processes.length ? [
    el("p", { class: "warn" }, "These processes use a GPU without holding its lease:"),
    table(["device", "user", "pid", "memory", "command"], s.unleased_processes.map((p) => [
      byUuid[p.device_uuid] ? name(byUuid[p.device_uuid]) : p.device_uuid, p.user || p.uid, p.pid,
      mib(p.used_memory_mib), p.command]), [2, 3])]
    : el("p", { class: "empty" }, "none"));
}

function holderText(d) {
  // As `vaccel status` words it: a Slurm job vaccel did not make names itself ("slurm job 42
  // (alice)"); a reservation is held by its user, not by a process (pid 0).
  if ((d.lease_id || "").startsWith("slurm-")) return d.holder.command;
  const who = el("span", { class: "user" }, d.holder.user || d.holder.uid);
  const container = d.holder.container;
  if (container) return [who, ` (container ${container.name || container.id.slice(0, 12)})`];
  return [who, d.holder.pid ? ` (pid ${d.holder.pid})` : " (reserved)"];
}

function deviceCard(d) {
  const card = el("div", { class: "card", data: { device: name(d), state: d.state, lease: d.lease_id || "" } },
    el("div", { class: "top" }, el("span", {}, name(d)), el("span", { class: `badge ${d.state}` }, d.state)),
    el("div", { class: "name", title: d.name }, `${d.name} · ${mib(d.memory_mib)}`));
  if (d.holder) {
    card.append(el("div", { class: "holder" }, holderText(d)));
    const left = d.time_left_s > 0 ? `${duration(d.time_left_s - (now() - state.statusAt))} left` : "no time limit";
    card.append(el("div", { class: "meta" }, `since ${clock(d.since)} (${duration(now() - d.since)}) · ${left}`));
    card.append(el("div", { class: "meta" }, `lease ${d.lease_id}`));
  } else if (d.shares && d.shares.length) {  // memory shares: each holder, budget and use
    for (const share of d.shares) {
      card.append(el("div", { class: "holder" }, el("span", { class: "user" }, share.user || share.uid),
        ` · ${mib(share.memory_mib)} share, uses ${mib(share.used_mib)}`));
    }
  } else if (d.drain_reason) {
    card.append(el("div", { class: "meta" }, `drained: ${d.drain_reason}`));
  } else if (!d.healthy) {
    card.append(el("div", { class: "meta" }, d.health_reason || "unhealthy"));
  } else {
    card.append(el("div", { class: "meta" }, "free"));
  }
  // Busy percent only where the probe reports it (an old daemon sends 0 for unknown).
  const used = d.memory_mib ? Math.min(1, d.memory_used_mib / d.memory_mib) : 0;
  const busy = d.utilization > 0 ? ` · ${Math.round(d.utilization)}% busy` : "";
  card.append(el("div", { class: "meta" }, `memory in use ${mib(d.memory_used_mib)}${busy}`));
  const bar = el("div");
  bar.style.width = `${Math.round(used * 100)}%`;
  card.append(el("div", { class: "meter", title: "memory in use" }, bar));
  return card;
}

// -- the 24 h timeline ------------------------------------------------------------------

function renderTimeline() {
  const t = state.timeline;
  if (!t) return;
  const box = document.getElementById("timeline");
  const width = Math.max(400, box.clientWidth || 900), row = 26, left = 56, right = 10, top = 4;
  const height = top + t.devices.length * row + 22;
  const until = Math.max(t.until, now());
  const earliest = Math.min(until, ...t.devices.flatMap((d) => d.spans.map((s) => s.start)));
  const [shown, step] = ZOOMS.find(([w]) => w >= (until - earliest) * 1.05) || ZOOMS[ZOOMS.length - 1];
  const since = until - Math.min(shown, t.until - t.since);
  document.getElementById("timeline-title").textContent = `Last ${ZOOM_NAMES[shown]}: who held each device`;
  const x = (ts) => left + ((ts - since) / (until - since)) * (width - left - right);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img",
    "aria-label": "who held each device over the last 24 hours" });
  const axisY = top + t.devices.length * row;
  for (let tick = Math.ceil(since / step) * step; tick <= until; tick += step) {
    chart.append(svg("line", { class: "grid", x1: x(tick), x2: x(tick), y1: top, y2: axisY }));
    const label = step < 60 ? new Date(tick * 1000).toLocaleTimeString([], { hour12: false }) : clock(tick);
    chart.append(svg("text", { class: "axis", x: x(tick), y: axisY + 14, "text-anchor": "middle" }, label));
  }
  const users = new Map();
  t.devices.forEach((device, i) => {
    const y = top + i * row;
    chart.append(svg("text", { x: 4, y: y + row / 2 + 4 }, name(device)));
    chart.append(svg("rect", { x: left, y: y + 3, width: width - left - right, height: row - 6, fill: "#f1f3f6" }));
    for (const span of device.spans.filter((s) => s.end === null || s.end > since)) {
      const x0 = x(Math.max(span.start, since)), x1 = x(span.end === null ? until : span.end);
      const w = Math.max(1.5, x1 - x0);
      // A past holder is named only where the lab shows usage to everyone; otherwise the
      // span says the device was in use (grey), as `vaccel status` said at the time.
      if (span.user) users.set(span.user, (users.get(span.user) || 0) + ((span.end === null ? until : span.end) - span.start));
      const rect = svg("rect", { x: x0, y: y + 3, width: w, height: row - 6, rx: 2,
        fill: span.user ? color(span.user) : "#9ca3af" });
      rect.append(svg("title", {}, `${span.user ? `${span.user} · ${span.lease_id}` : "in use"} · ${clock(span.start)}–` +
        (span.end === null ? "now" : clock(span.end))));
      chart.append(rect);
      if (span.user && w > 8 * String(span.user).length + 8) {
        chart.append(svg("text", { x: x0 + 4, y: y + row / 2 + 4, fill: "#fff" }, span.user));
      }
    }
  });
  chart.append(svg("line", { class: "now", x1: x(until), x2: x(until), y1: top, y2: axisY }));
  box.replaceChildren(chart);
  fill("legend", [...users.keys()].sort().map((user) => {
    const item = el("span", {}, user);
    item.style.setProperty("--swatch", color(user));
    return item;
  }));
  if (!state.report) renderUsageFromTimeline();
}

// -- bar charts: device-hours and waits -------------------------------------------------

function bars(id, items, format, colors) {
  // items: [{label, values: [number, ...]}]; one bar per value, side by side in a row.
  const box = document.getElementById(id);
  if (!items.length) { box.replaceChildren(el("p", { class: "empty" }, "nothing yet")); return; }
  const width = Math.max(260, box.clientWidth || 400), label = 90, valueRoom = 70;
  const per = items[0].values.length, bar = 12, row = per * bar + 8;
  const max = Math.max(...items.flatMap((item) => item.values), 1e-9);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${items.length * row}`, height: items.length * row, role: "img" });
  items.forEach((item, i) => {
    const y = i * row + 4;
    chart.append(svg("text", { x: 0, y: y + (per * bar) / 2 + 4 }, String(item.label).slice(0, 14)));
    item.values.forEach((value, j) => {
      const w = Math.max(1, (value / max) * (width - label - valueRoom));
      const fillColor = colors ? colors[j] : color(item.label);
      chart.append(svg("rect", { x: label, y: y + j * bar, width: w, height: bar - 2, rx: 2, fill: fillColor }));
      chart.append(svg("text", { class: "axis", x: label + w + 4, y: y + j * bar + bar - 3 }, format(value, j)));
    });
  });
  box.replaceChildren(chart);
}

function renderUsageFromTimeline() {
  // No accounting in this daemon: device-hours of the last 24 h per device, from the timeline.
  const t = state.timeline;
  if (!t) return;
  document.getElementById("usage-title").textContent = "Last 24 hours: device-hours per device";
  // Until the report has answered (the first paint), nothing is known of it: say so, not that
  // this daemon keeps none (loadReport sets reportNote when it does not).
  document.getElementById("usage-note").textContent = state.reportNote || "Loading the usage report…";
  const until = now();
  bars("usage", t.devices.map((d) => ({
    label: name(d),
    values: [d.spans.reduce((sum, s) => sum + ((s.end === null ? until : s.end) - s.start), 0) / 3600],
  })), hours, ["#2563eb"]);
}

function renderReport() {
  const r = state.report;
  renderWaits();
  if (!r) { fill("report", el("p", { class: "empty" }, state.reportNote)); renderUsageFromTimeline(); return; }
  document.getElementById("usage-title").textContent = `This week: device-hours per ${state.reportBy}`;
  document.getElementById("usage-note").textContent = state.reportBy === "user" ? "" :
    "Per-user rows are shown to admins only (vaccel report); here per device.";
  bars("usage", r.rows.map((row) => ({ label: rowLabel(row.key), values: [row.device_hours] })), hours,
    state.reportBy === "user" ? null : ["#2563eb"]);
  const rows = [...r.rows, ...(r.total ? [{ ...r.total, key: "total" }] : [])];
  const when = (ts) => new Date(ts * 1000).toLocaleString([], { hour12: false, dateStyle: "medium", timeStyle: "short" });
  fill("report", el("p", { class: "note" }, `${when(r.since)} – ${when(r.until)}`),
    table([state.reportBy, "device-hours", "leases", "wait p50", "wait p90", "idle device-hours"],
      rows.map((row) => [rowLabel(row.key), (row.device_hours || 0).toFixed(1), row.leases || 0, duration(row.wait_p50_s || 0),
        duration(row.wait_p90_s || 0), row.idle_measured ? (row.idle_device_hours || 0).toFixed(1) : "-"]),
      [1, 2, 3, 4, 5]));
}

function renderWaits() {
  const s = state.status, r = state.report;
  const waiting = s ? s.queue.map((q) => ({ label: `#${q.position} ${q.requester.user}`, values: [now() - q.since] })) : [];
  if (r && r.rows.length) {
    document.getElementById("waits-note").textContent =
      "Waits before a grant this week: median (dark) and 90th percentile." + (waiting.length ? " Below: waiting now." : "");
    const rows = r.rows.map((row) => ({ label: rowLabel(row.key), values: [row.wait_p50_s || 0, row.wait_p90_s || 0] }));
    bars("waits", rows.concat(waiting.map((w) => ({ label: w.label, values: [w.values[0], 0] }))),
      (v, j) => (j === 1 && !v ? "" : duration(v)), ["#1e3a8a", "#93c5fd"]);
  } else {
    document.getElementById("waits-note").textContent = "Waiting now" + (r ? "" : state.reportMissing
      ? " (past waits come from the usage report, which this daemon does not keep)"
      : state.reportNote ? ` (past waits: ${state.reportNote})` : " (loading past waits…)") + ".";
    bars("waits", waiting, (v) => duration(v), ["#b45309"]);
  }
}

// -- fetching and the live stream -------------------------------------------------------

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) { const error = new Error(await response.text()); error.status = response.status; throw error; }
  return response.json();
}

async function loadTimeline() {
  try { state.timeline = await getJSON("/api/timeline?hours=24"); renderTimeline(); } catch (e) { /* next change retries */ }
}

async function loadReport() {
  try {
    let report = await getJSON("/api/report?since=7d&by=user");
    state.reportBy = "user";
    if (report.rows_hidden) { report = await getJSON("/api/report?since=7d&by=device"); state.reportBy = "device"; }
    state.report = report;
  } catch (e) {
    state.report = null;
    state.reportMissing = e.status === 404;
    state.reportNote = e.status === 404 ? "accounting not available: this daemon keeps no usage report"
      : "the report could not be loaded";
  }
  document.body.dataset.report = state.report ? "shown" : "missing";  // for scripts that wait for it
  renderReport();
}

let timelineTimer = null;
function soon(fn, ms) { clearTimeout(timelineTimer); timelineTimer = setTimeout(fn, ms); }

function onStatus(data) {
  state.status = data;
  state.statusAt = now();
  renderStatus();
  renderWaits();
  soon(loadTimeline, 300);  // a burst of changes fetches the timeline once
  document.getElementById("live").textContent = `live · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
}

function connect() {
  const live = document.getElementById("live");
  const events = new EventSource("/events");
  events.addEventListener("status", (e) => onStatus(JSON.parse(e.data)));
  events.onopen = () => { live.className = "live on"; };
  events.onerror = () => { live.className = "live off"; live.textContent = "reconnecting…"; };
}

function start() {
  getJSON("/api/status").then(onStatus).catch(() => {});
  loadTimeline();
  loadReport();
  connect();
  setInterval(() => { renderStatus(); renderWaits(); }, 1000);  // the clocks on the page move on
  setInterval(loadTimeline, 60000);
  setInterval(loadReport, 60000);
  window.addEventListener("resize", () => { renderTimeline(); renderReport(); });
}

document.addEventListener("DOMContentLoaded", start);
