// prefix-router status page: polls the admin API (GET /fleet, GET /config) with the
// bearer token kept in sessionStorage, and renders with textContent only (instance ids
// and request ids come from outside: never parsed as HTML).
"use strict";

const TOKEN_KEY = "prefix-router-admin-token";
const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);
let timer = null;

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(path) {
  const headers = token() ? { Authorization: "Bearer " + token() } : {};
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) { const e = new Error("unauthorized"); e.status = 401; throw e; }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms");
const num = (x) => (x === null || x === undefined ? "–" : String(Math.round(x * 100) / 100));

function bar(fraction, hot, marker) {
  const b = el("span", null, hot ? "bar hot" : "bar");
  const fill = el("span");
  fill.style.width = Math.max(0, Math.min(1, fraction)) * 100 + "%";
  b.appendChild(fill);
  if (marker !== undefined) {
    const m = el("i");
    m.style.left = Math.max(0, Math.min(1, marker)) * 100 + "%";
    b.appendChild(m);
  }
  return b;
}

// Window value when there was traffic in the window, else the cumulative one, marked.
function windowed(recent, cumulative, fmt) {
  if (recent !== null && recent !== undefined) return el("span", fmt(recent));
  if (cumulative === null || cumulative === undefined) return el("span", "–", "muted");
  const s = el("span", fmt(cumulative), "muted");
  s.title = "no traffic in the window: since start";
  return s;
}

function cell(row, content, cls) {
  const td = el("td", null, cls);
  if (content instanceof Node) td.appendChild(content); else td.textContent = content;
  row.appendChild(td);
  return td;
}

function card(label, value, title) {
  const c = el("div", null, "card");
  c.appendChild(el("span", label, "muted"));
  const b = el("b");
  if (value instanceof Node) b.appendChild(value); else b.textContent = value;
  c.appendChild(b);
  if (title) c.title = title;
  return c;
}

function renderFleet(f) {
  $("fleet-version").textContent = f.fleet_version;
  $("config-version").textContent = f.config_version;
  $("published").textContent = f.published_snapshot || "none";
  $("threshold").textContent = f.concurrency_threshold ?? "off";
  $("spill-policy").textContent = f.spill_policy;
  $("spill-limit").textContent = f.spill_limit;
  $("window").textContent = f.window_s;

  const t = f.fleet;
  const cards = $("fleet-cards");
  cards.replaceChildren(
    card("hit rate (vLLM)", windowed(t.hit_rate, t.hit_rate_cumulative, pct),
      "prefix-cache tokens hit / queried, all instances"),
    card("predicted affinity", windowed(t.predicted_affinity, t.predicted_affinity_cumulative, pct),
      "share of routing decisions sent home"),
    card("TTFT p50", windowed(t.ttft_p50_s, t.ttft_p50_s_cumulative, ms)),
    card("TTFT p99", windowed(t.ttft_p99_s, t.ttft_p99_s_cumulative, ms)),
    card("in flight", num(t.in_flight)),
    card("running / waiting", num(t.running) + " / " + num(t.waiting)),
    card("decisions home / spilled",
      (t.decisions.home || 0) + " / " + (t.decisions.spilled || 0)),
  );

  const limit = Math.max(1, f.spill_limit || f.concurrency_threshold || 1);
  const body = $("instances").tBodies[0];
  body.replaceChildren(...f.instances.map((i) => {
    const tr = el("tr");
    tr.dataset.instance = i.id;
    cell(tr, i.id);
    const state = i.state + (i.healthy ? "" : ", unhealthy") + (i.removing ? ", removing" : "");
    cell(tr, state, i.routable ? "" : "bad");
    cell(tr, i.weight, "num");
    const share = el("span");
    share.append(bar(i.ring_share, false), el("span", pct(i.ring_share), "share"));
    cell(tr, share);
    const load = el("span");
    if (i.in_flight === null) load.append(el("span", "unknown", "muted"));
    else load.append(bar(i.in_flight / (limit * 1.5), i.in_flight >= limit, 1 / 1.5),
                     el("span", i.in_flight + " / " + limit, "in-flight"));
    cell(tr, load);
    cell(tr, windowed(i.hit_rate, i.hit_rate_cumulative, pct), "num");
    cell(tr, windowed(i.ttft_p50_s, i.ttft_p50_s_cumulative, ms), "num");
    cell(tr, windowed(i.ttft_p99_s, i.ttft_p99_s_cumulative, ms), "num");
    cell(tr, num(i.running), "num");
    cell(tr, num(i.waiting), "num");
    cell(tr, pct(i.kv_cache_usage), "num");
    const up = cell(tr, i.up ? "ok" : "down", i.up ? "" : "bad");
    if (i.error) up.title = i.error;
    return tr;
  }));

  renderPools(f.models);

  $("spills").tBodies[0].replaceChildren(...f.spills.map((s) => {
    const tr = el("tr");
    cell(tr, s.time ? new Date(s.time * 1000).toLocaleTimeString() : "–");
    cell(tr, s.request_id || "–");
    cell(tr, s.home);
    cell(tr, s.to);
    cell(tr, s.home_in_flight, "num");
    return tr;
  }));

  $("xds").tBodies[0].replaceChildren(...f.xds_clients.map((c) => {
    const tr = el("tr");
    cell(tr, c.node_id);
    cell(tr, c.connected ? "yes" : "no", c.connected ? "" : "bad");
    cell(tr, Object.entries(c.acked).map(([k, v]) => k + " " + v).join(", ") || "–");
    cell(tr, Object.keys(c.nacked).join(", ") || "–", Object.keys(c.nacked).length ? "bad" : "");
    return tr;
  }));

  const problems = [f.state_error && "shared state: " + f.state_error,
                    f.loads_error && "load store: " + f.loads_error].filter(Boolean);
  const status = $("status");
  status.textContent = "updated " + new Date().toLocaleTimeString() +
    (problems.length ? " · " + problems.join(" · ") : "");
  status.className = problems.length ? "bad" : "muted";
}

// Pools by model (control_plane/models.py pools_doc); hidden for a fleet without models.
function renderPools(m) {
  const pooled = Boolean(m && m.pooled);
  $("pools-section").hidden = !pooled;
  if (!pooled) return;
  const rows = Object.entries(m.pools).map(([model, ids]) => [model, ids]);
  if (m.catch_all.length) rows.push(["any other model", m.catch_all]);
  $("pools").tBodies[0].replaceChildren(...rows.map(([model, ids]) => {
    const tr = el("tr");
    tr.dataset.pool = model;
    cell(tr, model);
    cell(tr, ids.join(", ") || "none");
    return tr;
  }));
  $("model-disagreements").textContent = m.disagreements.map((d) =>
    d.instance + ": declared only " + (d.declared_only.join(", ") || "–") +
    "; found only " + (d.discovered_only.join(", ") || "–")).join(" · ");
}

// prefix-router up's supervisor: every process, its restarts and the recent exits
// (absent when the control plane does not run under up).
function renderSupervision(report) {
  $("processes").hidden = !report;
  if (!report) return;
  const time = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");
  $("components").tBodies[0].replaceChildren(...report.components.map((c) => {
    const tr = el("tr");
    tr.dataset.component = c.name;
    cell(tr, c.name);
    cell(tr, c.pid === null ? "–" : c.pid, "num");
    cell(tr, c.state, c.state === "running" ? "" : "bad");
    cell(tr, c.restarts, "num restarts");
    cell(tr, c.last_exit ? c.last_exit + " at " + time(c.last_exit_time) : "–",
      c.last_exit ? "last-exit" : "muted");
    return tr;
  }));
  $("supervision-events").tBodies[0].replaceChildren(...report.events.map((e) => {
    const tr = el("tr");
    cell(tr, time(e.time));
    cell(tr, e.component);
    if (e.kind === "exit") {
      cell(tr, e.status + " after " + num(e.uptime_s) + " s; restart in " + num(e.restart_in_s) +
        " s", "bad");
      const details = el("details");
      details.append(el("summary", "log"), el("pre", e.log_tail || ""));
      cell(tr, details);
    } else {
      cell(tr, "back (restart " + e.restarts + ", " + num(e.down_s) + " s down)");
      cell(tr, "");
    }
    return tr;
  }));
}

function renderConfig(c) {
  $("config").textContent = "version " + c.version + "\n" + JSON.stringify(c.config, null, 2);
}

function showLogin(reason) {
  clearTimeout(timer);
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-reason").textContent = reason;
  $("status").textContent = "";
  $("token").focus();
}

async function poll() {
  try {
    const [fleet, config] = await Promise.all([api("/fleet"), api("/config")]);
    $("login").hidden = true;
    $("main").hidden = false;
    renderFleet(fleet);
    renderSupervision(fleet.supervision);
    renderConfig(config);
  } catch (e) {
    if (e.status === 401) {
      showLogin(token() ? "That token was refused; enter the admin token."
                        : "The admin API needs its bearer token.");
      return;
    }
    $("status").textContent = "cannot reach the admin API: " + e.message;
    $("status").className = "bad";
  }
  timer = setTimeout(poll, POLL_MS);
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  poll();
});

poll();
