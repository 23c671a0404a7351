// pagedserve /dashboard: reads snapshots from dashboard/events (Server-Sent Events read with
// fetch, since EventSource cannot send the Authorization header) and draws them.
// Every URL is relative to the page, so the page works behind a proxy prefix.
"use strict";

const FREE = 0, USED = 1, SHARED = 2, CACHED = 3;
const KEY_STORAGE = "pagedserve-api-key";
const $ = (id) => document.getElementById(id);

// The newest snapshot and what the page derived from it (read by the browser tests).
const dashboard = { snapshot: null, pools: [], charts: null };
window.dashboard = dashboard;

// -- connection --------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").classList.toggle("error", Boolean(isError));
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  setStatus("API key needed", true);
  $("key").focus();
}

async function connect() {
  let response;
  try {
    response = await fetch("dashboard/events", { headers: authHeaders(), cache: "no-store" });
  } catch (err) {
    return retry("cannot reach the server: " + err.message);
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_STORAGE);
    return askForKey("the server refused this key");
  }
  if (!response.ok) return retry("the server answered " + response.status);
  $("key-form").hidden = true;
  setStatus("live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: "))
          .map((l) => l.slice(6)).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (err) {
    return retry("stream interrupted: " + err.message);
  }
  retry("the server closed the stream");
}

function retry(why) {
  setStatus(why + "; reconnecting", true);
  setTimeout(connect, 2000);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key").value);
  $("key-form").hidden = true;
  connect();
});

// -- drawing -----------------------------------------------------------------------------

function decode(b64, Type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Type(bytes.buffer);
}

function requestColour(id) {
  let h = 0;
  for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
  return `hsl(${h % 360}, 65%, 45%)`;
}

function render(snap) {
  dashboard.snapshot = snap;
  $("model").textContent = snap.model || "";
  $("step").textContent = snap.step;
  const requests = snap.running.concat(snap.waiting);
  // With data parallelism each replica has its own pool: block ids repeat across them.
  snap.pools.forEach((pool, i) => renderPool(pool, i,
    requests.filter((r) => (r.replica || 0) === pool.replica)));
  // The adapter column shows only on a server with LoRA adapters (--enable-lora).
  document.body.classList.toggle("lora", Boolean(snap.lora));
  renderRequests("running", snap.running);
  renderRequests("waiting", snap.waiting);
  renderSteps(snap.steps);
  renderLatency(snap.latency);
  renderSpecDecoding(snap.spec_decoding);
  document.body.dataset.step = snap.step;
}

function poolElements(i) {
  let el = $("pool-" + i);
  if (el) return el;
  el = document.createElement("div");
  el.className = "pool";
  el.id = "pool-" + i;
  el.innerHTML = `<canvas></canvas><dl>
    <dt>replica</dt><dd data-total="replica"></dd>
    <dt>blocks</dt><dd data-total="total"></dd>
    <dt>used</dt><dd data-total="used"></dd>
    <dt>shared</dt><dd data-total="shared"></dd>
    <dt>free</dt><dd data-total="free"></dd>
    <dt>cached, free</dt><dd data-total="cached_free"></dd>
    <dt>tokens stored</dt><dd data-total="tokens"></dd>
    <dt>internal fragmentation</dt><dd data-total="fragmentation"></dd></dl>`;
  $("pools").appendChild(el);
  const canvas = el.querySelector("canvas");
  canvas.addEventListener("mousemove", (e) => showBlock(i, canvas, e));
  canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  return el;
}

function renderPool(wire, i, requests) {
  const state = decode(wire.state, Uint8Array);
  const filled = decode(wire.filled, wire.filled_dtype === "uint16" ? Uint16Array : Uint8Array);
  const holders = new Map();
  for (const r of requests) {
    for (const b of r.blocks) {
      if (!holders.has(b)) holders.set(b, []);
      holders.get(b).push(r.id);
    }
  }
  // Counted here from the block states, independently of the engine's own totals.
  const counts = [0, 0, 0, 0];
  let tokens = 0;
  for (let b = 0; b < state.length; b++) {
    counts[state[b]]++;
    if (state[b] === USED || state[b] === SHARED) tokens += filled[b];
  }
  const used = counts[USED] + counts[SHARED];
  const pool = { wire, state, filled, holders, used, layout: null };
  dashboard.pools[i] = pool;
  const el = poolElements(i);
  const set = (name, value) => { el.querySelector(`[data-total=${name}]`).textContent = value; };
  set("replica", wire.replica);
  set("total", state.length);
  set("used", used);
  set("shared", counts[SHARED]);
  set("free", counts[FREE] + counts[CACHED]);
  set("cached_free", counts[CACHED]);
  set("tokens", tokens);
  set("fragmentation", used ? (100 * (1 - tokens / (used * wire.block_size))).toFixed(1) + " %"
    : "–");
  drawPool(el.querySelector("canvas"), pool);
}

function drawPool(canvas, pool) {
  const n = pool.state.length;
  const width = Math.max(300, Math.min(900, $("pools").clientWidth - 320));
  const cell = Math.max(2, Math.min(16, Math.floor(Math.sqrt((width * 360) / n))));
  const cols = Math.floor(width / cell);
  const rows = Math.ceil(n / cols);
  canvas.width = cols * cell;
  canvas.height = rows * cell;
  pool.layout = { cell, cols };
  const ctx = canvas.getContext("2d");
  const gap = cell >= 4 ? 1 : 0;
  const bs = pool.wire.block_size;
  let drawn = 0;
  for (let b = 0; b < n; b++) {
    const s = pool.state[b];
    if (s === FREE) ctx.fillStyle = "#e6e6e6";
    else if (s === CACHED) ctx.fillStyle = "#9ecae1";
    else if (s === SHARED) ctx.fillStyle = "#212121";
    else ctx.fillStyle = requestColour(pool.holders.get(b)[0]);
    ctx.globalAlpha = s === USED ? 0.35 + (0.65 * pool.filled[b]) / bs : 1;
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
    drawn++;
  }
  ctx.globalAlpha = 1;
  canvas.dataset.cells = drawn;
}

function showBlock(i, canvas, event) {
  const pool = dashboard.pools[i];
  if (!pool || !pool.layout) return;
  const rect = canvas.getBoundingClientRect();
  const { cell, cols } = pool.layout;
  const col = Math.floor((event.clientX - rect.left) / cell);
  const b = Math.floor((event.clientY - rect.top) / cell) * cols + col;
  const tip = $("tooltip");
  if (col >= cols || b < 0 || b >= pool.state.length) { tip.hidden = true; return; }
  const names = ["free", "held", "shared", "cached, free (evictable)"];
  const holders = pool.holders.get(b) || [];
  let text = `block ${b}: ${names[pool.state[b]]}\n` +
    `slots filled ${pool.filled[b]} / ${pool.wire.block_size}\nref count ${holders.length}`;
  if (holders.length) text += "\nholders " + holders.join(", ");
  tip.textContent = text;
  tip.style.left = event.clientX + 12 + "px";
  tip.style.top = event.clientY + 12 + "px";
  tip.hidden = false;
}

function renderRequests(which, rows) {
  $("num-" + which).textContent = `(${rows.length})`;
  $(which).tBodies[0].replaceChildren(...rows.map(requestRow));
}

function requestRow(r) {
  const tr = document.createElement("tr");
  tr.dataset.requestId = r.id;
  const texts = [r.id, r.lora_name || "base", `${r.prompt_computed} / ${r.prompt_tokens}`,
    r.output_tokens, r.blocks.length, r.cached_tokens, r.preemptions, r.age.toFixed(1) + " s"];
  // textContent only: ids and adapter names come from clients, never parsed as HTML.
  for (const text of texts) tr.insertCell().textContent = text;
  tr.cells[1].className = "adapter";
  const swatch = document.createElement("span");
  swatch.className = "swatch";
  swatch.style.background = requestColour(r.id);
  tr.cells[0].prepend(swatch);
  const bar = document.createElement("span");
  bar.className = "bar";
  bar.appendChild(document.createElement("i")).style.width =
    (r.prompt_tokens ? (100 * r.prompt_computed) / r.prompt_tokens : 0) + "%";
  tr.cells[2].prepend(bar);
  return tr;
}

function chart(id, title, series, axes) {
  return new uPlot({
    title, width: Math.min(1100, $(id).clientWidth || 900), height: 170,
    scales: { x: { time: false } },
    series: [{ label: "step" }, ...series],
    axes: [{ label: "step" }, ...axes],
  }, [[]].concat(series.map(() => [])), $(id));
}

function renderSteps(steps) {
  if (!dashboard.charts) {
    const bars = uPlot.paths.bars({ size: [0.9, 8] });
    dashboard.charts = {
      tokens: chart("chart-tokens", "Tokens scheduled per step", [
        { label: "prefill", stroke: "#ef6c00", fill: "rgba(239,108,0,.35)", paths: bars },
        { label: "decode", stroke: "#1e88e5", fill: "rgba(30,136,229,.35)", paths: bars },
      ], [{ label: "tokens" }]),
      time: chart("chart-time", "Step time, rows and preemptions", [
        { label: "step time (ms)", stroke: "#6a1b9a", scale: "ms" },
        { label: "rows", stroke: "#2e7d32", scale: "n" },
        { label: "preemptions", stroke: "#c62828", scale: "n", points: { show: true } },
      ], [{ label: "ms", scale: "ms" }, { label: "count", scale: "n", side: 1 }]),
      blocks: chart("chart-blocks", "Blocks used and queues after each step", [
        { label: "used blocks", stroke: "#00838f", scale: "b" },
        { label: "running", stroke: "#2e7d32", scale: "n" },
        { label: "waiting", stroke: "#f9a825", scale: "n" },
      ], [{ label: "blocks", scale: "b" }, { label: "requests", scale: "n", side: 1 }]),
    };
  }
  const c = dashboard.charts;
  c.tokens.setData([steps.step, steps.prefill_tokens, steps.decode_tokens]);
  c.time.setData([steps.step, steps.duration.map((d) => d * 1000), steps.num_rows,
    steps.num_preempted.map((n) => n || null)]);  // a point only where preemptions happened
  c.blocks.setData([steps.step, steps.used_blocks, steps.num_running, steps.num_waiting]);
}

function renderLatency(latency) {
  if (!latency.window) return;
  $("latency-window").textContent = latency.window;
  const ms = (v) => (v === null ? "–" : (v * 1000).toFixed(1) + " ms");
  const names = { ttft: "TTFT", tpot: "TPOT", e2e: "end-to-end" };
  $("latency").tBodies[0].innerHTML = Object.entries(names).map(([k, label]) => {
    const row = latency[k];
    return `<tr data-metric="${k}"><td>${label}</td><td>${row.count}</td>` +
      `<td>${ms(row.p50)}</td><td>${ms(row.p90)}</td><td>${ms(row.p99)}</td></tr>`;
  }).join("");
}

function renderSpecDecoding(spec) {
  // Speculative decoding's acceptance since the server started (absent without it).
  const el = $("spec-decoding");
  el.hidden = !spec;
  if (!spec) return;
  const rate = spec.acceptance_rate === null ? "–" : (100 * spec.acceptance_rate).toFixed(1) + "%";
  const perPos = spec.num_accepted_tokens_per_pos.map((n) =>
    spec.num_drafts ? (100 * n / spec.num_drafts).toFixed(0) + "%" : "–").join(", ");
  el.innerHTML = `Speculative decoding: acceptance rate <b data-spec="rate">${rate}</b> ` +
    `(${spec.num_accepted_tokens} of ${spec.num_draft_tokens} draft tokens, ` +
    `${spec.num_drafts} drafts); accepted by position ${perPos}`;
}

// -- start -------------------------------------------------------------------------------

const keyRequired = document.querySelector('meta[name="pagedserve-auth"]').content ===
  "api-key-required";
if (keyRequired && !sessionStorage.getItem(KEY_STORAGE)) askForKey();
else connect();
