// The hivemesh monitor's page: polls /api/state and draws it. Every string from the network
// (peer ids, names, error messages) goes into the page through textContent or setAttribute,
// never as HTML.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function num(v, digits) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (Math.abs(v) >= 1e6) return v.toExponential(2);
  return v.toFixed(digits);
}

function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  if (s < 86400 * 365) return (s / 3600).toFixed(1) + " h";
  return "> 1 year";
}

function ago(now, t) {
  if (!Number.isFinite(t)) return "–";
  return duration(Math.max(0, now - t)) + " ago";
}

function el(tag, attrs, content) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (content !== undefined) e.textContent = content;
  return e;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

// A line chart of `series` ([{name, color, points: [[t, v], ...]}]) over the times `t0..t1`.
function chart(id, series, t0, t1) {
  const svg = document.getElementById(id);
  const W = svg.clientWidth || 320, H = svg.clientHeight || 130;
  const left = 44, right = 8, top = 8, bottom = 18;
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const values = series.flatMap(s => s.points.map(p => p[1])).filter(Number.isFinite);
  let lo = Math.min(0, ...values), hi = Math.max(...values, 1e-9);
  if (values.length && Math.min(...values) > 0 && series.some(s => s.name === "loss")) lo = Math.min(...values);
  if (hi - lo < 1e-9) hi = lo + 1;
  const x = t => left + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (W - left - right);
  const y = v => top + (1 - (v - lo) / (hi - lo)) * (H - top - bottom);
  for (const v of [lo, (lo + hi) / 2, hi]) {
    svg.appendChild(svgEl("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    const label = svgEl("text", { class: "axis", x: left - 4, y: y(v) + 3, "text-anchor": "end" });
    label.textContent = num(v, hi - lo < 10 ? 2 : 0);
    svg.appendChild(label);
  }
  const span = svgEl("text", { class: "axis", x: W - right, y: H - 4, "text-anchor": "end" });
  span.textContent = "last " + duration(t1 - t0);
  svg.appendChild(span);
  let drawn = 0;
  for (const s of series) {
    const pts = s.points.filter(p => Number.isFinite(p[1]));
    if (!pts.length) continue;
    const d = pts.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1)).join(" ");
    svg.appendChild(svgEl("path", { class: "line", d, stroke: s.color, "data-series": s.name, "data-points": pts.length }));
    if (pts.length === 1) svg.appendChild(svgEl("circle", { cx: x(pts[0][0]), cy: y(pts[0][1]), r: 3, fill: s.color }));
    drawn += pts.length;
  }
  svg.setAttribute("data-points", String(drawn));
}

function render(s) {
  const g = s.global;
  text("run-id", s.run_id);
  text("epoch", String(g.epoch));
  text("rate", num(g.samples_per_second, 1));
  text("eta", duration(g.eta_seconds));
  text("samples", g.target_batch_size === null ? String(g.samples_accumulated)
    : g.samples_accumulated + " / " + g.target_batch_size);
  text("peers", String(g.num_peers));
  text("clients", String(g.num_clients));
  text("loss", num(g.loss, 4));
  text("rounds", g.rounds_ok + " / " + g.rounds_failed);
  const status = s.last_error ? "last fetch failed: " + s.last_error
    : s.last_fetch === null ? "waiting for the first fetch…" : "updated " + ago(s.now, s.last_fetch);
  text("status", status);
  const notes = [`${s.fetches} fetches`, `${s.rejected_records} malformed records ignored`,
    `history: last ${s.history_len} fetches`, `table: ${s.max_peers} peers at most`];
  if (s.untracked_peers) notes.push(`${s.untracked_peers} live peers not shown (table full)`);
  text("footer", notes.join(" · "));

  const h = s.history;
  const t1 = h.length ? h[h.length - 1].time : s.now, t0 = h.length ? h[0].time : s.now;
  const pts = f => h.map(p => [p.time, f(p)]);
  chart("chart-rate", [{ name: "samples/s", color: "#5b8def", points: pts(p => p.samples_per_second) }], t0, t1);
  chart("chart-peers", [
    { name: "peers", color: "#2e7d32", points: pts(p => p.peers) },
    { name: "clients", color: "#f9a825", points: pts(p => p.clients) },
  ], t0, t1);
  chart("chart-loss", [{ name: "loss", color: "#c62828", points: pts(p => p.loss === null ? NaN : p.loss) }], t0, t1);
  chart("chart-rounds", [
    { name: "rounds ok", color: "#2e7d32", points: pts(p => p.rounds_ok) },
    { name: "rounds failed", color: "#c62828", points: pts(p => p.rounds_failed) },
    { name: "group size", color: "#6a1b9a", points: pts(p => p.group_size === null ? NaN : p.group_size) },
  ], t0, t1);

  const body = document.querySelector("#peer-table tbody");
  const rows = s.peers.map(p => {
    const tr = el("tr", { class: p.status, "data-peer": p.peer_id });
    const id = el("td", { title: p.peer_id }, p.short_id);
    const share = el("td");
    share.appendChild(el("span", { class: "bar", style: `width:${Math.round(60 * p.share)}px` }));
    share.appendChild(document.createTextNode((100 * p.share).toFixed(1) + " %"));
    const status = el("td");
    status.appendChild(el("span", { class: "pill" }, p.status === "gone" ? "gone " + ago(s.now, p.gone_since) : "live"));
    tr.append(id, el("td", { class: "name", title: p.name }, p.name), status, el("td", {}, p.reach),
      el("td", {}, p.mode), el("td", {}, p.epoch === null ? "–" : String(p.epoch)),
      el("td", {}, num(p.samples_per_second, 1)), share, el("td", {}, num(p.loss, 4)),
      el("td", {}, p.rounds_ok === null ? "–" : p.rounds_ok + " / " + p.rounds_failed),
      el("td", {}, p.group_size ? String(p.group_size) : "–"), el("td", {}, ago(s.now, p.last_seen)));
    return tr;
  });
  body.replaceChildren(...rows);
}

async function poll() {
  try {
    const r = await fetch("/api/state", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    text("status", "monitor unreachable: " + e.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
