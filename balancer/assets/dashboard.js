// Flowgate dashboard: polls the management API and redraws. No framework,
// no build step; everything is written with textContent (never innerHTML),
// since agent names and tenants come from the network.
"use strict";

const REFRESH_MS = 2000;
const OUTCOME_CLASSES = ["c0", "c1", "c2", "c3", "c4"];
let refreshes = 0;

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function bytes(n) {
  if (n < 1024) return n + " B";
  if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KiB";
  if (n < 1024 * 1024 * 1024) return (n / 1024 / 1024).toFixed(1) + " MiB";
  return (n / 1024 / 1024 / 1024).toFixed(2) + " GiB";
}

function age(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms < 10000 ? (ms / 1000).toFixed(1) + " s" : Math.round(ms / 1000) + " s";
}

function bar(fraction) {
  const b = el("span", null, fraction >= 0.9 ? "bar high" : "bar");
  const fill = el("span");
  fill.style.width = Math.round(Math.max(0, Math.min(1, fraction)) * 100) + "%";
  b.appendChild(fill);
  return b;
}

function cell(row, field, text, cls) {
  const td = el("td", text, cls);
  td.dataset.field = field;
  row.appendChild(td);
  return td;
}

function endpointState(ep) {
  const r = ep.agent;
  if (!r) return ["leaving (finishing requests)", "warn"];
  if (ep.circuit_open_ms !== null && ep.circuit_open_ms !== undefined) return ["circuit open", "bad"];
  if (ep.stale) return ["stale reports", "bad"];
  if (r.draining) return ["draining", "warn"];
  if (!ep.eligible) return ["not ready", "bad"];
  if (ep.saturation) return ["saturated: " + ep.saturation, "warn"];
  return ["taking work", "ok"];
}

function renderAgents(endpoints) {
  const body = $("agents").tBodies[0];
  const rows = [];
  for (const ep of endpoints) {
    const r = ep.agent;
    const row = el("tr");
    row.dataset.agent = r ? r.agent_id : "endpoint-" + ep.id;
    // The operator's --name, with the random agent id on hover.
    const agent = cell(row, "agent", r ? r.name || r.agent_id : "–");
    if (r) agent.title = r.agent_id;
    cell(row, "endpoint", ep.addr);
    cell(row, "backend", r ? r.backend : "–");
    cell(row, "models", r && r.models.length ? r.models.join(", ") : "any");
    cell(row, "health", r ? r.health : "–", r && r.health === "ready" ? "ok" : "bad");
    if (r) {
      const slots = cell(row, "slots", r.slots_busy + " / " + r.slots_total);
      slots.appendChild(bar(r.slots_total ? r.slots_busy / r.slots_total : 0));
      const kv = r.kv_cache_usage;
      const kvCell = cell(row, "kv", kv === null || kv === undefined ? "–" : Math.round(kv * 100) + " %");
      if (kv !== null && kv !== undefined) kvCell.appendChild(bar(kv));
      cell(row, "queue", r.requests_waiting);
    } else {
      cell(row, "slots", "–"); cell(row, "kv", "–"); cell(row, "queue", "–");
    }
    // What the engine said it reused: Σcached / Σprompt of its answers.
    const c = ep.cache;
    const hits = c && c.prompt_tokens > 0 ? c.cached_tokens / c.prompt_tokens : null;
    const hitCell = cell(row, "cache_hits", hits === null ? "–" : Math.round(hits * 100) + " %");
    if (hits !== null) {
      hitCell.appendChild(bar(hits));
      hitCell.title = c.cached_tokens + " of " + c.prompt_tokens + " prompt tokens; expected hits: " +
        c.predicted_hits + " confirmed, " + c.predicted_misses + " missed";
    }
    const cost = ep.cost;
    const costCell = cell(row, "cost", cost && cost.samples > 0
      ? cost.prefill_ms_per_token.toFixed(2) + " ms/tok · " + Math.round(cost.service_ms) + " ms"
      : "–");
    if (cost) costCell.title = "decode " + cost.decode_ms_per_token.toFixed(1) + " ms/token; from the last " + cost.samples + " answers";
    // LoRA adapters: those loaded (or running) of the most it holds.
    const ad = r && r.adapters;
    const held = ad ? (ad.loaded || ad.running) : [];
    const adCell = cell(row, "adapters", !ad ? "–" :
      held.length + (ad.max_loaded ? " / " + ad.max_loaded : "") + (held.length ? ": " + held.join(", ") : ""));
    if (ad) adCell.title = "running: " + (ad.running.join(", ") || "none") + "; waiting: " +
      (ad.waiting.join(", ") || "none") + "; servable: " + ad.servable.length;
    cell(row, "in_flight", ep.in_flight);
    cell(row, "report_age", age(ep.report_age_ms), ep.stale ? "bad" : "");
    const [state, cls] = endpointState(ep);
    cell(row, "state", state, cls);
    rows.push(row);
  }
  body.replaceChildren(...rows);
  $("agents-empty").classList.toggle("hidden", rows.length > 0);
}

function renderFlows(flows) {
  const sorted = flows.slice().sort((a, b) => b.priority - a.priority || a.fairness_id.localeCompare(b.fairness_id));
  const rows = sorted.map(f => {
    const row = el("tr");
    row.dataset.flow = f.priority + "/" + f.fairness_id;
    cell(row, "priority", f.priority);
    cell(row, "tenant", f.fairness_id === "" ? "(none)" : f.fairness_id);
    cell(row, "requests", f.requests);
    cell(row, "bytes", bytes(f.bytes));
    return row;
  });
  $("flows").tBodies[0].replaceChildren(...rows);
  $("flows-empty").classList.toggle("hidden", rows.length > 0);
}

// The ten tenants that spent the most tokens in the last hour; `usage` is
// null when the balancer keeps it behind the management token.
function renderTenants(usage) {
  const rows = (usage ? usage.tenants : []).map(t => {
    const row = el("tr");
    row.dataset.tenant = t.tenant;
    cell(row, "tenant", t.tenant);
    cell(row, "requests", t.requests);
    cell(row, "prompt", t.prompt_tokens.toLocaleString());
    cell(row, "completion", t.completion_tokens.toLocaleString());
    cell(row, "cached", t.cached_tokens.toLocaleString());
    return row;
  });
  $("tenants").tBodies[0].replaceChildren(...rows);
  $("tenants-empty").textContent = usage ? "No answered request yet." :
    "Usage needs the management token (GET /api/v1/usage with Authorization: Bearer).";
  $("tenants-empty").classList.toggle("hidden", rows.length > 0);
}

const SVG = "http://www.w3.org/2000/svg";

// Draws series (arrays of numbers or nulls, one per point) into an svg with a
// 300x90 viewBox; the y axis starts at 0 and ends at the largest value.
function chart(svg, series, unit) {
  const w = 300, h = 90, top = 10;
  const values = series.flatMap(s => s.values).filter(v => v !== null && v !== undefined);
  const max = Math.max(...values, 0) || 1;
  const n = Math.max(1, ...series.map(s => s.values.length - 1));
  const parts = [];
  const grid = document.createElementNS(SVG, "line");
  grid.setAttribute("x1", 0); grid.setAttribute("x2", w);
  grid.setAttribute("y1", top); grid.setAttribute("y2", top);
  parts.push(grid);
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", 2); label.setAttribute("y", top - 2);
  label.textContent = values.length ? (max < 10 ? max.toPrecision(2) : Math.round(max)) + unit : "no data";
  parts.push(label);
  for (const s of series) {
    // A null ends a segment: nothing happened, so nothing is drawn.
    let points = [];
    const flush = () => {
      if (points.length === 1) {
        // A lone reading: a dot, since a line needs two.
        const dot = document.createElementNS(SVG, "circle");
        dot.setAttribute("cx", points[0][0]);
        dot.setAttribute("cy", points[0][1]);
        dot.setAttribute("r", 2);
        dot.setAttribute("class", s.cls);
        parts.push(dot);
      } else if (points.length > 1) {
        const line = document.createElementNS(SVG, "polyline");
        line.setAttribute("points", points.map(p => p.join(",")).join(" "));
        line.setAttribute("class", s.cls);
        parts.push(line);
      }
      points = [];
    };
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { flush(); return; }
      const x = (i / n) * w;
      const y = h - (v / max) * (h - top);
      points.push([x.toFixed(1), y.toFixed(1)]);
    });
    flush();
  }
  svg.replaceChildren(...parts);
}

function renderHistory(history) {
  const points = history.points;
  chart($("chart-outcomes"), history.outcomes.map((name, i) => ({
    cls: OUTCOME_CLASSES[i], values: points.map(p => p.rates[i]),
  })), "/s");
  chart($("chart-ttft"), [
    { cls: "c0", values: points.map(p => p.ttft_p50) },
    { cls: "c3", values: points.map(p => p.ttft_p99) },
  ], " s");
  chart($("chart-wait"), [
    { cls: "c0", values: points.map(p => p.wait_p50) },
    { cls: "c3", values: points.map(p => p.wait_p99) },
  ], " s");
  // The share met per interval (none answered: nothing drawn), and over the
  // window; the last interval's goodput on hover.
  chart($("chart-objectives"), [
    { cls: "c0", values: points.map(p => p.objectives_answered ? p.objectives_met / p.objectives_answered : null) },
  ], "");
  const answered = points.reduce((sum, p) => sum + p.objectives_answered, 0);
  const met = points.reduce((sum, p) => sum + p.objectives_met, 0);
  const last = points[points.length - 1];
  const metLegend = $("legend-objectives");
  metLegend.textContent = answered
    ? "met " + met + " of " + answered + " (" + Math.round(100 * met / answered) + " %)"
    : "none with an objective";
  metLegend.title = "goodput (met a second), last interval: " + (last ? last.goodput.toFixed(2) : "0") + "/s";
  // Each outcome with its count over the whole window.
  const legend = history.outcomes.map((name, i) => {
    const total = points.reduce((sum, p) => sum + p.counts[i], 0);
    const span = el("span", name + " (" + total + ")");
    span.dataset.outcome = name;
    span.prepend(el("i", null, OUTCOME_CLASSES[i]));
    return span;
  });
  $("legend-outcomes").replaceChildren(...legend);
  $("tile-rate").textContent = last ? last.rates.reduce((a, b) => a + b, 0).toFixed(1) : "–";
}

function renderSummary(view) {
  const ready = view.endpoints.filter(ep => ep.eligible).length;
  $("tile-agents").textContent = ready + " / " + view.endpoints.length;
  $("tile-in-flight").textContent = view.in_flight_requests;
  $("tile-buffered").textContent = view.buffered_requests + " / " + view.max_buffered_requests;
  $("tile-buffered-bytes").textContent = bytes(view.buffered_bytes);
  $("tile-unserved").textContent = view.unserved_demand.reduce((a, d) => a + d.requests, 0);
}

async function fetchJson(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

async function refresh() {
  try {
    const [view, history, usage] = await Promise.all([
      fetchJson("/api/v1/agents"), fetchJson("/api/v1/history"),
      fetchJson("/api/v1/usage?limit=10").catch(() => null)]);
    renderSummary(view);
    renderAgents(view.endpoints);
    renderFlows(view.flows);
    renderTenants(usage);
    renderHistory(history);
    refreshes += 1;
    document.body.dataset.refreshes = refreshes;
    const status = $("status");
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.classList.remove("error");
  } catch (e) {
    const status = $("status");
    status.textContent = "cannot reach the balancer: " + e.message;
    status.classList.add("error");
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
