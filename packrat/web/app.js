// Packrat status page: views of the controller's /v1 API. The one thing it changes is a
// model's pin (PUT /v1/models/{model}/pin): pinned, the re-plan loop and the tuner leave it.
//
// The management key is typed in by the user and kept in this tab's
// sessionStorage only; without it nothing is fetched and nothing is shown.
// Every value from the server goes into the page through textContent or
// setAttribute (never innerHTML), so a model name or an error text cannot
// become markup. The charts are SVG elements drawn here: nothing is loaded
// from anywhere but this controller.
"use strict";

const KEY_NAME = "packrat.managementKey";
const POLL_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";
// Decisions seen while the page is open, per model (the controller keeps only the latest 50).
const KEEP_DECISIONS = 2000;
const decisionLog = new Map();
let timer = null;
let generation = 0; // bumped on "forget": answers to older requests are dropped

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// -- formatting --------------------------------------------------------------------
const num = (x, digits = 1) => (typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–");
// Two significant digits below 1 ms: a no-op model's 0.04 ms is not "0.0 ms".
const ms = (x) => (typeof x === "number" && isFinite(x) ? `${x > 0 && x < 1 ? x.toPrecision(2) : x.toFixed(1)} ms` : "–");
const secs = (x) => (typeof x === "number" && isFinite(x) ? `${x.toFixed(1)} s` : "–");
function clock(t) {
  if (typeof t !== "number" || !isFinite(t)) return "–";
  return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

// "2 × 1t/b2" (workers × threads/batch cap), the same shape string as packrat_live_plan_info.
function shapeText(plan) {
  if (!plan || !Array.isArray(plan.instances)) return "not a Packrat plan";
  const counts = new Map();
  for (const i of plan.instances) {
    const k = `${i.threads}t/b${i.batch}`;
    counts.set(k, (counts.get(k) || 0) + 1);
  }
  return [...counts].map(([k, n]) => `${n} × ${k}`).join(" + ");
}

// -- the key -----------------------------------------------------------------------
const getKey = () => sessionStorage.getItem(KEY_NAME);

function forget(message) {
  sessionStorage.removeItem(KEY_NAME);
  generation += 1;
  if (timer !== null) clearTimeout(timer);
  timer = null;
  decisionLog.clear();
  $("models").replaceChildren();
  $("health").replaceChildren();
  $("health").className = "health";
  $("session").hidden = true;
  $("key-form").hidden = false;
  $("key-message").textContent = message || "";
}

class Refused extends Error {}

async function api(path, method = "GET", body = undefined) {
  const key = getKey();
  if (!key) throw new Refused("no key");
  const headers = { Authorization: `Bearer ${key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
    credentials: "omit",
    referrerPolicy: "no-referrer",
  });
  if (r.status === 401) throw new Refused("the controller refused this key");
  if (!r.ok) {
    const e = new Error(`${path}: HTTP ${r.status}`);
    e.status = r.status;
    throw e;
  }
  return r.json();
}

async function optional(path) {
  try {
    return await api(path);
  } catch (e) {
    if (e instanceof Refused) throw e;
    return null; // e.g. 409: the re-plan loop is not running in this controller
  }
}

// -- polling -----------------------------------------------------------------------
async function refresh() {
  const mine = generation;
  try {
    const models = await api("v1/models");
    const views = [];
    for (const m of models) {
      const name = m.model;
      const q = encodeURIComponent(name);
      const [status, adapt, jobs] = await Promise.all([
        api(`v1/models/${q}/status`),
        optional(`v1/models/${q}/adapt?last=50`),
        optional(`v1/jobs?model=${q}&last=10`),
      ]);
      views.push({ name, status, adapt, jobs });
    }
    const health = await fetch("healthz", { cache: "no-store", credentials: "omit" })
      .then((r) => r.json()).catch(() => null);
    if (mine !== generation) return;
    render(views, health);
    $("updated").textContent = `updated ${clock(Date.now() / 1000)}`;
    $("key-message").textContent = "";
  } catch (e) {
    if (mine !== generation) return;
    if (e instanceof Refused) {
      forget(e.message === "no key" ? "" : "The controller refused this key (401). Type the current management key.");
      return;
    }
    $("updated").textContent = `could not refresh: ${e.message}`;
  }
  if (mine === generation && getKey()) timer = setTimeout(refresh, POLL_MS);
}

// Pin (what is live) or unpin a model, then show the result at once.
async function setPin(name, pinned) {
  try {
    await api(`v1/models/${encodeURIComponent(name)}/pin`, "PUT", { pinned });
  } catch (e) {
    if (e instanceof Refused) { forget("The controller refused this key (401). Type the current management key."); return; }
    $("updated").textContent = `could not ${pinned ? "pin" : "unpin"} ${name}: ${e.message}`;
    return;
  }
  if (timer !== null) clearTimeout(timer);
  timer = null;
  refresh();
}

// "tokens p50 6 p90 115 (240 requests)" per kind served; "–" before any (status's traffic).
function trafficText(traffic) {
  const kinds = traffic && typeof traffic === "object" ? Object.entries(traffic) : [];
  if (!kinds.length) return "–";
  return kinds.map(([kind, t]) => `${kind} p50 ${t.p50} p90 ${t.p90} (${t.requests} requests)`).join(", ");
}

// The request sizes the last tune profiled at: the traffic's, or the task's own sample.
function tunedForText(tune) {
  if (!tune || !tune.sizes || typeof tune.sizes !== "object") return "–";
  const kinds = Object.entries(tune.sizes);
  return kinds.length ? kinds.map(([kind, size]) => `${kind} ${size}`).join(", ") : "the task's sample input";
}

// "tokens 5": the request sizes a prediction is for (status's predicted_for, a decision's
// predicted_for and traffic_sizes); "not known" without them (a profile that did not record them).
function sizesText(sizes) {
  const kinds = sizes && typeof sizes === "object" ? Object.entries(sizes) : [];
  return kinds.length ? kinds.map(([kind, size]) => `${kind} ${size}`).join(", ") : "not known";
}

function pinText(pin) {
  if (!pin) return "not pinned";
  return `pinned: ${pin.mode || "its mode"} ${shapeText(pin.plan)} since ${clock(pin.since)}`;
}

function start() {
  $("key-form").hidden = true;
  $("session").hidden = false;
  $("updated").textContent = "loading…";
  refresh();
}

// -- rendering -----------------------------------------------------------------------
function render(views, health) {
  const h = $("health");
  if (health) {
    h.textContent = health.status === "ok" ? "healthy" : `unhealthy: ${(health.problems || []).join("; ")}`;
    h.className = health.status === "ok" ? "health ok" : "health bad";
  }
  const sections = views.map((v) => modelSection(v));
  if (sections.length === 0) sections.push(el("p", { class: "empty" }, "TorchServe has no models registered."));
  $("models").replaceChildren(...sections);
}

// What is under way beyond the tune's last word (as `packrat status` leads a model's stage):
// a swap bringing a new version up, or the last plan the restart watch is to apply again.
// A tune's "applied X" stays its text while a later swap still brings its version up.
function underWayText(status) {
  const swap = status.swap_in_progress;
  if (swap && swap.model === status.model) {
    const version = swap.to_version ? ` as version ${swap.to_version}` : "";
    return `swapping to ${targetText(swap.plan, "a new plan")}${version} (${swap.phase || "starting"})`;
  }
  const lost = status.lost_plan;
  if (lost) {
    return `to apply its last plan again (${targetText(lost.plan, "a Packrat plan")}: version ${lost.version} is no longer loaded)`;
  }
  return "–";
}

// A plan's wire form as "<mode> <shape>" (what it has of them), else `otherwise`.
function targetText(plan, otherwise) {
  const p = plan || {};
  const words = [p.mode, Array.isArray(p.instances) && p.instances.length ? shapeText(p) : null].filter(Boolean);
  return words.length ? words.join(" ") : otherwise;
}

function dl(rows) {
  const list = el("dl");
  for (const [k, v, cls] of rows) {
    list.append(el("dt", {}, k), el("dd", cls ? { class: cls } : {}, v));
  }
  return list;
}

function modelSection({ name, status, adapt, jobs }) {
  const plan = status.plan;
  const decisions = remember(name, adapt ? adapt.decisions : []);
  const last = decisions.length ? decisions[decisions.length - 1] : null;
  const obs = status.observed || {};
  const workers = status.workers || [];
  const planned = workers.filter((w) => w.as_planned === true).length;

  const live = dl([
    ["version", status.version, "live-version"],
    ["mode", status.mode || (plan && plan.mode) || "–", "live-mode"],
    ["plan", plan ? shapeText(plan) : "not a Packrat plan", "live-plan"],
    ["planned for", plan ? `B = ${plan.batch} on ${plan.cores} cores` : "–"],
    ["workers", plan ? `${workers.length} (${planned} as planned)` : String(workers.length)],
    ["cores", Array.isArray(status.cores) ? status.cores.join(",") : "–"],
    // The cores this model may use now (divided among models with load: docs/cores.md).
    ["may use", Array.isArray(status.share) ? status.share.join(",") : "–"],
    ["pin", pinText(status.pin), "pin"],
    ["under way", underWayText(status), "under-way"],
    // The input shape served (the workers' size histograms) and the one the last tune profiled at.
    ["traffic", trafficText(status.traffic), "traffic"],
    ["tuned for", tunedForText(status.tune), "tuned-for"],
  ]);
  const pinButton = el("button", { type: "button", class: "pin-button" }, status.pin ? "Unpin" : "Pin what is live");
  pinButton.addEventListener("click", () => { pinButton.disabled = true; setPin(name, !status.pin); });
  const latency = dl([
    ["predicted", ms(status.predicted_latency_ms), "predicted-latency"],
    // The input that prediction is for, beside the traffic's (above): a 5-token figure says
    // little of 128-token texts.
    ["predicted for", status.predicted_latency_ms ? sizesText(status.predicted_for) : "–", "predicted-for"],
    ["observed (recent)", recentText(obs)],
    ["observed (overall)", ms(obs.mean_latency_ms), "observed-latency"],
    ["requests", typeof obs.requests_total === "number" ? String(obs.requests_total) : "–"],
    ["at est. B: pred. / obs.", last ? `${ms(last.current_ms > 0 ? last.current_ms : null)} / ${ms(last.observed_ms)}` : "–"],
    ["at est. B: for / traffic lately", last ? `${sizesText(last.predicted_for)} / ${sizesText(last.traffic_sizes)}` : "–", "decision-sizes"],
  ]);
  const loop = dl([
    ["re-plan loop", adapt ? (adapt.enabled ? "on" : "off (plan fixed)") : "not running"],
    ["last decision", last ? `${last.reason}${last.swap ? " (swap)" : ""}` : "–", "last-decision"],
    ["estimated B", last && last.estimated_batch !== null ? String(last.estimated_batch) : "–"],
    ["at", last ? clock(last.time_s) : "–"],
  ]);

  return el("section", { class: "model", "data-model": name },
    el("h2", {}, name),
    el("div", { class: "grid" },
      el("div", {}, el("h3", {}, "Live"), live, pinButton),
      el("div", {}, el("h3", {}, "Latency"), latency),
      el("div", {}, el("h3", {}, "Re-plan"), loop)),
    el("h3", {}, "Decisions over time"),
    el("div", { class: "charts" },
      batchChart(decisions, status.last_swaps || []),
      latencyChart(decisions, status.predicted_latency_ms)),
    el("h3", {}, "Tuning and profiling"),
    progress(status.tune, jobs || []),
    el("h3", {}, "Swaps"),
    swapTable(status.swap_in_progress, status.last_swaps || []));
}

// The mean since the previous status call (the page polls every few seconds).
function recentText(obs) {
  if (typeof obs.recent_window_s !== "number") return "–";
  if (typeof obs.recent_mean_latency_ms !== "number") return `no requests in the last ${secs(obs.recent_window_s)}`;
  return `${ms(obs.recent_mean_latency_ms)} over the last ${secs(obs.recent_window_s)}`;
}

// Merge the controller's latest decisions into what this page has seen (keyed by time).
function remember(model, latest) {
  const seen = decisionLog.get(model) || [];
  const lastT = seen.length ? seen[seen.length - 1].time_s : -Infinity;
  for (const d of latest || []) if (typeof d.time_s === "number" && d.time_s > lastT) seen.push(d);
  if (seen.length > KEEP_DECISIONS) seen.splice(0, seen.length - KEEP_DECISIONS);
  decisionLog.set(model, seen);
  return seen;
}

function progress(tune, jobs) {
  const box = el("div", { class: "progress" });
  if (tune) {
    box.append(dl([
      ["tune", `${tune.state || "–"}${tune.stage ? ` (${tune.stage})` : ""}`, "tune-state"],
      ["", tune.text || ""],
    ]));
    const modes = tune.modes && typeof tune.modes === "object" ? Object.entries(tune.modes) : [];
    if (modes.length) {
      const t = el("table", { class: "tune-modes" }, el("tr", {}, el("th", {}, "mode"), el("th", {}, "state"), el("th", {}, "note")));
      for (const [mode, m] of modes) {
        let note = "";
        if (m && typeof m === "object") {
          const points = typeof m.points_total === "number" ? `${m.points_done || 0}/${m.points_total} points` : "";
          note = m.reason || m.why || points || (typeof m.points === "number" ? `${m.points} points` : "");
        }
        t.append(el("tr", {}, el("td", {}, mode), el("td", {}, m && m.state ? m.state : "–"), el("td", {}, note)));
      }
      box.append(t);
    }
  } else {
    box.append(el("p", { class: "empty" }, "never tuned"));
  }
  if (jobs.length) {
    const t = el("table", { class: "jobs" },
      el("tr", {}, el("th", {}, "job"), el("th", {}, "kind"), el("th", {}, "state"), el("th", {}, "started"),
        el("th", {}, "finished"), el("th", {}, "progress")));
    for (const j of jobs.slice().reverse()) {
      const p = j.progress && typeof j.progress === "object" ? (j.progress.text || j.progress.stage || "") : "";
      t.append(el("tr", {}, el("td", {}, j.id), el("td", {}, j.kind), el("td", {}, j.state),
        el("td", {}, clock(j.created)), el("td", {}, clock(j.finished)), el("td", {}, j.error ? j.error.split("\n")[0] : p)));
    }
    box.append(t);
  }
  return box;
}

// "create 0.0 s, ready 2.1 s (worker_start 0.4 s, model_load 1.2 s, ...), ..." when the
// record splits the ready phase (ready_phases_s), else the phases alone.
function phasesText(phases, ready) {
  if (!phases || typeof phases !== "object") return "–";
  const split = ready && typeof ready === "object" ? Object.entries(ready) : [];
  const parts = Object.entries(phases).map(([k, v]) => (k === "ready" && split.length
    ? `${k} ${secs(v)} (${split.map(([r, t]) => `${r} ${secs(t)}`).join(", ")})`
    : `${k} ${secs(v)}`));
  return parts.length ? parts.join(", ") : "–";
}

function swapTable(running, swaps) {
  const t = el("table", { class: "swaps" },
    el("tr", {}, el("th", {}, "started"), el("th", {}, "from → to"), el("th", {}, "plan"), el("th", {}, "outcome"),
      el("th", {}, "took"), el("th", {}, "phases")));
  const rows = swaps.slice().reverse();
  if (running) rows.unshift({ ...running, outcome: `running: ${running.phase || "starting"}` });
  for (const s of rows) {
    t.append(el("tr", {},
      el("td", {}, clock(s.started_at)),
      el("td", {}, `${s.from_version || "–"} → ${s.to_version || "–"}`),
      el("td", {}, shapeText(s.plan)),
      el("td", { class: `outcome-${String(s.outcome).replace(/[^a-z_]/g, "")}` },
        s.outcome, s.error ? el("div", {}, String(s.error).slice(0, 300)) : null),
      el("td", {}, secs(s.duration_s)),
      el("td", {}, phasesText(s.phases_s, s.ready_phases_s))));
  }
  if (!rows.length) return el("p", { class: "empty" }, "no swaps yet");
  return t;
}

// -- charts ----------------------------------------------------------------------------
const W = 520, H = 210, PAD = { l: 44, r: 12, t: 40, b: 24 };

// One SVG chart: lines of (time_s, value) points, and vertical markers at given times.
function chart(title, series, markers, yUnit) {
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  root.append(svg("text", { x: PAD.l, y: 14 }, title));
  const pts = series.flatMap((s) => s.points);
  if (pts.length === 0) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no decisions yet"));
    return root;
  }
  const times = pts.map((p) => p[0]).concat(markers.map((m) => m.t));
  let t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...times);
  if (t1 - t0 < 60) t0 = t1 - 60; // at least a minute wide
  const ymax = Math.max(1, ...pts.map((p) => p[1])) * 1.15;
  const x = (t) => PAD.l + ((t - t0) / (t1 - t0)) * (W - PAD.l - PAD.r);
  const y = (v) => H - PAD.b - (v / ymax) * (H - PAD.t - PAD.b);
  // Axes and grid: 4 horizontal lines, time labels at both ends.
  for (let i = 0; i <= 4; i += 1) {
    const v = (ymax / 4) * i;
    root.append(svg("line", { x1: PAD.l, x2: W - PAD.r, y1: y(v), y2: y(v), stroke: "#e3e6ec" }));
    root.append(svg("text", { x: PAD.l - 4, y: y(v) + 4, "text-anchor": "end" }, v >= 10 ? v.toFixed(0) : v.toFixed(1)));
  }
  root.append(svg("text", { x: 4, y: PAD.t - 6 }, yUnit));
  const ago = (t) => `-${Math.round((t1 - t) / 60)} min`;
  root.append(svg("text", { x: PAD.l, y: H - 6 }, ago(t0)));
  root.append(svg("text", { x: W - PAD.r, y: H - 6, "text-anchor": "end" }, clock(t1).slice(11)));
  for (const m of markers) {
    if (m.t < t0) continue;
    root.append(svg("line", { x1: x(m.t), x2: x(m.t), y1: PAD.t, y2: H - PAD.b, stroke: m.color, "stroke-dasharray": "3 3" }));
  }
  let lx = PAD.l; // the legend: a row under the title
  for (const s of series) {
    if (s.points.length) {
      const d = s.points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
      root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8 }));
      if (s.points.length === 1) {
        root.append(svg("circle", { cx: x(s.points[0][0]), cy: y(s.points[0][1]), r: 3, fill: s.color }));
      }
    }
    root.append(svg("rect", { x: lx, y: 20, width: 10, height: 10, fill: s.color }));
    root.append(svg("text", { x: lx + 14, y: 29 }, s.label));
    lx += 20 + 7 * s.label.length;
  }
  return root;
}

function numbers(decisions, pick) {
  return decisions.map((d) => [d.time_s, pick(d)]).filter((p) => typeof p[1] === "number" && isFinite(p[1]));
}

function batchChart(decisions, swaps) {
  const markers = decisions.filter((d) => d.swap).map((d) => ({ t: d.time_s, color: "#b3261e" }))
    .concat(swaps.map((s) => ({ t: s.started_at, color: "#8a94a6" })));
  return chart("load batch B: estimated vs live plan (dashed: swaps)", [
    { label: "estimated B", color: "#2f6fdb", points: numbers(decisions, (d) => d.estimated_batch) },
    { label: "plan B", color: "#1f7a3a", points: numbers(decisions, (d) => d.active_batch) },
  ], markers, "B");
}

function latencyChart(decisions) {
  return chart("latency: predicted vs observed", [
    // 0: not predicted (an explicit plan applied without a profile).
    { label: "predicted", color: "#1f7a3a", points: numbers(decisions, (d) => (d.current_ms > 0 ? d.current_ms : null)) },
    { label: "observed", color: "#d9822b", points: numbers(decisions, (d) => d.observed_ms) },
  ], [], "ms");
}

// -- wiring ----------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("key");
    const key = input.value.trim();
    input.value = ""; // not left in the DOM
    if (!key) return;
    sessionStorage.setItem(KEY_NAME, key);
    generation += 1;
    start();
  });
  $("forget").addEventListener("click", () => forget(""));
  if (getKey()) start();
});
