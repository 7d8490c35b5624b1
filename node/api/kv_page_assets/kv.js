// The live KV block map: one cell per block of the node's pool, redrawn on each map the
// node sends over /kv/events (at most a few a second). Plain script, no build step.
"use strict";

const FREE = 0, CACHED = 1, HELD = 2, SHARED = 3;
const canvas = document.getElementById("grid");
const tip = document.getElementById("tip");
const counts = document.getElementById("counts");
const statusLine = document.getElementById("status");

let view = null; // the last map, decoded
let layout = { cell: 8, cols: 1 };
let drawPending = false;

function int32s(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Int32Array(bytes.buffer, 0, bytes.length >> 2); // little-endian on every browser we target
}

function bytesOf(b64) {
  return Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
}

function hue(text) {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return (h >>> 0) % 360;
}

// HSL (0-360, 0-1, 0-1) to packed little-endian RGBA for a Uint32Array over ImageData.
function rgba(h, s, l) {
  const a = s * Math.min(l, 1 - l);
  const f = (n) => {
    const k = (n + h / 30) % 12;
    return Math.round(255 * (l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
  };
  return (255 << 24) | (f(4) << 16) | (f(8) << 8) | f(0);
}

const FREE_RGBA = rgba(220, 0.13, 0.91);
const CACHED_RGBA = rgba(162, 0.38, 0.75);
const DARK_RGBA = rgba(220, 0.28, 0.17);

function decode(m) {
  const n = m.num_blocks;
  const state = new Uint8Array(n);
  const owner = new Int32Array(n).fill(-1);
  const position = new Int32Array(n);
  const refs = new Int32Array(n);
  const cachedAt = new Int32Array(n).fill(-1);
  const seqs = m.seqs.map((s) => ({ ...s, blocks: int32s(s.blocks), colour: 0 }));
  const requests = new Map();
  for (const s of seqs) {
    if (!requests.has(s.request)) requests.set(s.request, rgba(hue(s.request), 0.7, 0.56));
    s.colour = requests.get(s.request);
  }
  let used = 0;
  seqs.forEach((s, k) => {
    s.blocks.forEach((b, i) => {
      if (state[b] === FREE) used++;
      state[b] = HELD;
      refs[b] += 1;
      if (owner[b] < 0) { owner[b] = k; position[b] = i; }
    });
  });
  const sharedIds = int32s(m.shared.ids), sharedRefs = int32s(m.shared.refs);
  sharedIds.forEach((b, i) => { state[b] = SHARED; refs[b] = sharedRefs[i]; });
  const cachedIds = int32s(m.cached.ids);
  cachedIds.forEach((b, i) => { state[b] = CACHED; cachedAt[b] = i; });
  return {
    m, n, state, owner, position, refs, cachedAt, seqs, requests,
    hashes: bytesOf(m.cached.hashes), reuses: int32s(m.cached.reuses),
    used, shared: sharedIds.length, cached: cachedIds.length,
  };
}

function fitLayout(n) {
  const width = canvas.parentElement.clientWidth || 800;
  const height = Math.max(200, window.innerHeight - 24);
  let cell = Math.floor(Math.sqrt((width * height) / n));
  cell = Math.max(1, Math.min(24, cell));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(n / cols) };
}

function draw() {
  drawPending = false;
  if (!view) return;
  layout = fitLayout(view.n);
  const { cell, cols, rows } = layout;
  canvas.width = cols * cell;
  canvas.height = rows * cell;
  canvas.style.height = `${rows * cell * (canvas.clientWidth / canvas.width || 1)}px`;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(canvas.width, canvas.height);
  const px = new Uint32Array(image.data.buffer);
  const gap = cell >= 4 ? 1 : 0;
  const inner = cell >= 6 ? Math.floor(cell / 4) : -1;
  const W = canvas.width;
  for (let b = 0; b < view.n; b++) {
    const st = view.state[b];
    let colour = FREE_RGBA;
    if (st === CACHED) colour = CACHED_RGBA;
    else if (st !== FREE) colour = view.seqs[view.owner[b]].colour;
    const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
    for (let y = 0; y < cell - gap; y++) {
      const row = (y0 + y) * W + x0;
      for (let x = 0; x < cell - gap; x++) {
        const centre = st === SHARED && (inner < 0 || (x >= inner && x < cell - gap - inner &&
          y >= inner && y < cell - gap - inner));
        px[row + x] = centre ? DARK_RGBA : colour;
      }
    }
  }
  ctx.putImageData(image, 0, 0);
}

function percent(x) { return `${(100 * x).toFixed(1)} %`; }

function showCounts() {
  const v = view, m = v.m;
  const slots = v.used * m.block_size;
  const waste = slots ? m.waste_slots / slots : 0;
  const hitRate = m.prefix_queries ? m.prefix_hits / m.prefix_queries : 0;
  const free = v.n - v.used;
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("num-blocks", v.n.toLocaleString());
  set("used", v.used.toLocaleString());
  set("shared", v.shared.toLocaleString());
  set("cached", v.cached.toLocaleString());
  set("free", `${free.toLocaleString()} (${v.cached.toLocaleString()} cached)`);
  set("usage", percent(v.used / v.n));
  set("waste", percent(waste));
  set("hit-rate", percent(hitRate));
  set("running", m.running);
  set("waiting", m.waiting);
  Object.assign(counts.dataset, {
    seq: m.seq, blocks: v.n, used: v.used, shared: v.shared, cached: v.cached, free,
    running: m.running, waiting: m.waiting, waste: waste.toFixed(6),
    sequences: v.seqs.length, schedulerUsed: m.num_used,
  });
  const list = document.getElementById("requests");
  list.replaceChildren(...[...v.requests.keys()].map((r) => {
    const held = v.seqs.filter((s) => s.request === r);
    const li = document.createElement("li");
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = `hsl(${hue(r)} 70% 56%)`;
    li.append(sw, `${r} · ${held.length} seq`);
    return li;
  }));
}

function describe(b) {
  const v = view, bs = v.m.block_size;
  const st = v.state[b];
  if (st === FREE) return `block ${b}\nfree`;
  if (st === CACHED) {
    const i = v.cachedAt[b], k = v.m.cached.hash_bytes;
    const hash = [...v.hashes.subarray(i * k, (i + 1) * k)]
      .map((x) => x.toString(16).padStart(2, "0")).join("");
    return `block ${b}\ncached, evictable\nhash ${hash}…\nreused by ${v.reuses[i]} request(s)`;
  }
  const lines = [`block ${b}`, st === SHARED ? `shared, ${v.refs[b]} references` : "held"];
  v.seqs.forEach((s) => {
    const i = s.blocks.indexOf(b);
    if (i < 0) return;
    const start = i * bs, end = Math.min((i + 1) * bs, s.tokens);
    const range = end > start ? `tokens ${start}–${end - 1}` : "no token yet";
    lines.push(`${s.request} #${s.index}: ${range}`);
  });
  return lines.join("\n");
}

canvas.addEventListener("mousemove", (e) => {
  if (!view) return;
  const rect = canvas.getBoundingClientRect();
  const scale = canvas.width / rect.width;
  const col = Math.floor(((e.clientX - rect.left) * scale) / layout.cell);
  const row = Math.floor(((e.clientY - rect.top) * scale) / layout.cell);
  const b = row * layout.cols + col;
  if (col >= layout.cols || b < 0 || b >= view.n) { tip.hidden = true; return; }
  tip.textContent = describe(b);
  tip.hidden = false;
  tip.style.left = `${e.clientX - rect.left + 14}px`;
  tip.style.top = `${e.clientY - rect.top + 14}px`;
});
canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
window.addEventListener("resize", () => { if (!drawPending) { drawPending = true; requestAnimationFrame(draw); } });

function connect() {
  const source = new EventSource("/kv/events");
  source.addEventListener("map", (e) => {
    view = decode(JSON.parse(e.data));
    statusLine.textContent = "live";
    statusLine.className = "status";
    showCounts();
    if (!drawPending) { drawPending = true; requestAnimationFrame(draw); }
  });
  source.addEventListener("error", () => {
    statusLine.textContent = "reconnecting…";
    statusLine.className = "status error";
    if (source.readyState === EventSource.CLOSED) {
      // Refused (a wrong key, a node draining): ask again after a pause.
      setTimeout(() => location.reload(), 3000);
    }
  });
}

connect();
