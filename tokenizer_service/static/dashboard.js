// The cache dashboard: polls /v1/cache/stats and draws it. Plain JS, no build step, no library.
// With --api-key, open /dashboard#key=<key>: the fragment never leaves the browser; the key goes out only as the
// Authorization header of the stats requests. Cached prompt text is shown with textContent, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const apiKey = new URLSearchParams(location.hash.slice(1)).get("key");

const $ = (id) => document.getElementById(id);
const fmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const fmt1 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });
const percent = (x) => (x * 100).toFixed(1) + "%";

function setText(id, value) {
  $(id).textContent = value;
}

async function poll() {
  try {
    const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
    const response = await fetch("/v1/cache/stats", { headers, cache: "no-store" });
    const body = await response.json();
    if (!response.ok) {
      const why = body && body.error ? body.error.message : response.statusText;
      showStatus(response.status === 401 ? "API key needed: open /dashboard#key=<key> (" + why + ")" : why, true);
    } else {
      render(body);
      showStatus("updated " + new Date(body.time * 1000).toLocaleTimeString(), false);
    }
  } catch (error) {
    showStatus("server unreachable: " + error, true);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function showStatus(text, isError) {
  const status = $("status");
  status.textContent = text;
  status.className = isError ? "error" : "";
}

function render(s) {
  setText("model", s.model);
  setText("hit-rate", percent(s.cache_hit_rate));
  setText("tokens-cached", fmt.format(s.prompt_tokens_cached));
  setText("tokens-computed", fmt.format(s.prompt_tokens_computed));
  setText("running", fmt.format(s.num_running));
  setText("waiting", fmt.format(s.num_waiting));
  setText("in-flight", fmt.format(s.num_requests_in_flight));
  renderRates(s);
  renderKv(s);
  setText("host-tokens", s.hicache ? fmt.format(s.hicache_tokens) : "–");
  setText("host-detail", s.hicache
    ? "of " + fmt.format(s.hicache_capacity_tokens) + " tokens; " + fmt.format(s.hicache_hits) + " hits, " +
      fmt.format(s.hicache_loaded_tokens) + " loaded, " + fmt.format(s.hicache_saved_tokens) + " saved"
    : "host tier off (--hicache-size)");
  setText("policy", s.eviction_policy);
  setText("evicted", fmt.format(s.evicted_tokens));
  setText("pins", fmt.format(s.num_pins));
  drawChart(s.history);
  renderPrefixes(s);
}

// Rates between the last two samples of the server's history (at least a second apart).
function renderRates(s) {
  const rows = s.history.samples;
  if (rows.length < 2) return;
  const [now, before] = [rows[rows.length - 1], rows[rows.length - 2]];
  const delta = (name) => { const i = s.history.fields.indexOf(name); return now[i] - before[i]; };
  const dt = delta("time");
  const cached = delta("prompt_tokens_cached"), computed = delta("prompt_tokens_computed");
  setText("prefill-rate", fmt1.format(computed / dt));
  setText("decode-rate", fmt1.format(delta("decode_tokens") / dt));
  setText("cached-rate", fmt1.format(cached / dt));
  setText("hit-rate-recent", cached + computed ? percent(cached / (cached + computed)) : "no prompts");
  setText("rate-window", fmt1.format(dt) + " s");
}

function renderKv(s) {
  const total = Math.max(1, s.kv_total);
  for (const part of ["in_use", "pinned", "cached"]) {
    const id = "kv-" + part.replace("_", "-");
    $(id).style.width = (100 * s["kv_" + part] / total) + "%";
    setText(id + "-n", fmt.format(s["kv_" + part]));
  }
  setText("kv-free-n", fmt.format(s.kv_free));
  setText("kv-total-n", fmt.format(s.kv_total));
}

function ago(seconds) {
  if (seconds < 60) return Math.max(0, Math.round(seconds)) + " s ago";
  if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function renderPrefixes(s) {
  const rows = s.largest_prefixes.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.pinned = String(p.pinned);
    const cells = [
      [fmt.format(p.num_tokens), "num"], [fmt.format(p.hits), "num"], [ago(s.time - p.last_use), ""],
      [p.pinned ? "pinned" : "", p.pinned ? "pin" : ""], [p.tenant === null ? "shared" : p.tenant, ""],
      [p.text, "text"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 6;
    td.textContent = s.radix_cache ? "nothing cached yet" : "radix cache off (--disable-radix-cache)";
    tr.appendChild(td);
    rows.push(tr);
  }
  $("prefixes").replaceChildren(...rows);
}

// Cumulative prompt tokens as stacked areas (cached below, computed above) against the left axis, and the hit rate
// since start as a line against the right axis (0..100%). The samples are the server's recent answers
// (routes_dashboard.StatsHistory), so a page opened now draws the last minutes too.
function drawChart(history) {
  const field = (name) => history.fields.indexOf(name);
  const [iT, iCached, iComputed, iRate] = ["time", "prompt_tokens_cached", "prompt_tokens_computed",
                                           "cache_hit_rate"].map(field);
  const samples = history.samples.map((row) => ({ t: row[iT], cached: row[iCached], computed: row[iComputed],
                                                  hitRate: row[iRate] }));
  const canvas = $("chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const left = 64, right = width - 48, top = 10, bottom = height - 22;
  const maxTokens = Math.max(1, ...samples.map((p) => p.cached + p.computed));
  const t0 = samples[0].t, t1 = Math.max(t0 + 1, samples[samples.length - 1].t);
  const x = (t) => left + (right - left) * (t - t0) / (t1 - t0);
  const y = (tokens) => bottom - (bottom - top) * tokens / maxTokens;
  const yRate = (rate) => bottom - (bottom - top) * rate;

  g.font = "11px system-ui, sans-serif";
  g.fillStyle = color("--muted");
  g.strokeStyle = color("--line");
  g.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const yy = bottom - (bottom - top) * fraction;
    g.beginPath(); g.moveTo(left, yy); g.lineTo(right, yy); g.stroke();
    g.textAlign = "right"; g.fillText(fmt.format(maxTokens * fraction), left - 6, yy + 4);
    g.textAlign = "left"; g.fillText(Math.round(fraction * 100) + "%", right + 6, yy + 4);
  }
  g.textAlign = "left";
  g.fillText(new Date(t0 * 1000).toLocaleTimeString(), left, height - 6);
  g.textAlign = "right";
  g.fillText(new Date(t1 * 1000).toLocaleTimeString(), right, height - 6);

  const area = (lower, upper, fill) => {
    g.beginPath();
    samples.forEach((p, i) => (i ? g.lineTo : g.moveTo).call(g, x(p.t), y(upper(p))));
    for (let i = samples.length - 1; i >= 0; i--) g.lineTo(x(samples[i].t), y(lower(samples[i])));
    g.closePath();
    g.fillStyle = fill;
    g.fill();
  };
  if (samples.length > 1) {
    area(() => 0, (p) => p.cached, color("--cached"));
    area((p) => p.cached, (p) => p.cached + p.computed, color("--computed"));
    g.beginPath();
    samples.forEach((p, i) => (i ? g.lineTo : g.moveTo).call(g, x(p.t), yRate(p.hitRate)));
    g.strokeStyle = color("--in-use");
    g.lineWidth = 2;
    g.stroke();
  }
}

poll();
