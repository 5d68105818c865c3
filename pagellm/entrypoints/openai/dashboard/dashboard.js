// The pagellm KV cache dashboard: polls GET /v1/kv_cache/state and draws the block pool, the swap pool,
// the request queues, the counters of the last minutes and the engine's settings. Plain DOM and SVG,
// no library: every block is a <div> whose attributes (data-state, data-block-id, data-ref-count, title)
// say what it holds, so tests and screen readers read the grid as it is drawn.
"use strict";

(() => {
  const STATE_NAMES = { f: "free", u: "used", s: "shared", c: "cached", p: "pinned" };
  const STATE_LABELS = {
    free: "free", used: "in use by one sequence", shared: "shared", cached: "cached, evictable",
    pinned: "pinned", swapped: "swapped out",
  };
  const params = new URLSearchParams(location.search);
  // A few polls a second at most: each one is a snapshot the engine takes between two steps.
  const INTERVAL_MS = Math.min(5000, Math.max(250, Number(params.get("interval")) || 500));
  // Relative to /dashboard, so that the page also works behind a proxy that adds a path prefix.
  const STATE_URL = new URL("v1/kv_cache/state", location.href);
  const MAX_REQUEST_ROWS = 300;

  const $ = (id) => document.getElementById(id);
  const grid = $("kv-grid");
  let cells = [];
  let hovered = null;
  let renders = 0;
  let settingsKey = "";

  // Smaller cells for larger pools: the whole pool stays on one screen.
  function cellSize(n) {
    if (n <= 512) return 16;
    if (n <= 2048) return 12;
    if (n <= 8192) return 8;
    if (n <= 32768) return 5;
    return 3;
  }

  // Above this many blocks the cells are grouped in chunks of whole rows that the browser skips drawing
  // while they are off screen (content-visibility): a redraw then costs the rows in view, not the pool.
  const CHUNKED_ABOVE = 16384;
  const ROWS_PER_CHUNK = 8;
  let perRow = 0;

  function cellsPerRow(n) {
    const size = cellSize(n) + 1; // the cell and its 1px gap
    return Math.max(1, Math.floor((grid.clientWidth + 1) / size));
  }

  // Cells into chunks of ROWS_PER_CHUNK full rows (a chunk that began mid-row would leave a ragged edge).
  function chunkCells(n) {
    perRow = cellsPerRow(n);
    const per = perRow * ROWS_PER_CHUNK;
    grid.style.setProperty("--chunk-height", ROWS_PER_CHUNK * (cellSize(n) + 1) + "px");
    const frag = document.createDocumentFragment();
    for (let start = 0; start < n; start += per) {
      const chunk = document.createElement("div");
      chunk.className = "chunk";
      chunk.append(...cells.slice(start, start + per));
      frag.appendChild(chunk);
    }
    grid.replaceChildren(frag);
  }

  // A new grid: every cell drawn free (as the pool starts), so that the first update touches only the
  // blocks that are not.
  function buildGrid(n) {
    cells = new Array(n);
    for (let i = 0; i < n; i++) {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.setAttribute("data-block-id", i);
      cell.setAttribute("data-state", "free");
      cell.setAttribute("data-ref-count", "0");
      cell.title = `block ${i} · free · ref count 0`;
      cells[i] = cell;
    }
    grid.dataset.numBlocks = String(n);
    grid.style.setProperty("--cell", cellSize(n) + "px");
    grid.classList.toggle("chunked", n > CHUNKED_ABOVE);
    if (n > CHUNKED_ABOVE) {
      chunkCells(n);
    } else {
      grid.replaceChildren(...cells);
    }
    drawnStates = "f".repeat(n);
    drawnDetails = new Map();
  }

  new ResizeObserver(() => {
    if (cells.length > CHUNKED_ABOVE && cellsPerRow(cells.length) !== perRow) chunkCells(cells.length);
  }).observe(grid);

  function describe(id, state, ref, hash, who, hashesSent) {
    const parts = [`block ${id}`, state === "shared" ? `shared by ${ref}` : STATE_LABELS[state], `ref count ${ref}`];
    if (who && who.length) parts.push(`requests: ${who.join(", ")}`);
    if (hash) parts.push(`hash ${hash}`);
    else if (state === "cached" && !hashesSent) parts.push("hash not sent (too many cached blocks)");
    return parts.join(" · ");
  }

  // The state sends ref counts above 1 only: otherwise a block in use has 1, a free or cached one 0.
  function refCount(refs, i, state) {
    if (refs[i] !== undefined) return refs[i];
    return state === "free" || state === "cached" ? 0 : 1;
  }

  // What the grid shows now: one state code per cell, and the details (ref count, hash, holders) of the
  // cells that have any. An update redraws only the cells where either differs, so that a large pool
  // costs a character compare per cell, and no layout beyond the cells that changed.
  let drawnStates = "";
  let drawnDetails = new Map();

  function updateGrid(pool) {
    const n = pool.num_blocks;
    if (cells.length !== n) buildGrid(n);
    const { states, ref_counts: refs, hashes, holders } = pool;
    const changed = new Set();
    for (let i = 0; i < n; i++) if (states.charCodeAt(i) !== drawnStates.charCodeAt(i)) changed.add(i);
    const details = new Map();
    for (const table of [refs, hashes, holders]) {
      for (const id of Object.keys(table)) {
        const i = Number(id);
        if (!details.has(i)) {
          details.set(i, `${refs[id] ?? ""}|${hashes[id] ?? ""}|${holders[id] ? holders[id].join(" ") : ""}`);
        }
      }
    }
    for (const [i, key] of details) if (drawnDetails.get(i) !== key) changed.add(i);
    for (const i of drawnDetails.keys()) if (!details.has(i)) changed.add(i);
    const showCount = cellSize(n) >= 12;
    for (const i of changed) {
      const state = STATE_NAMES[states[i]] || "free";
      const ref = refCount(refs, i, state);
      const hash = hashes[i];
      const who = holders[i];
      const cell = cells[i];
      cell.setAttribute("data-state", state);
      cell.setAttribute("data-ref-count", ref);
      if (hash) cell.setAttribute("data-hash", hash); else cell.removeAttribute("data-hash");
      if (who) cell.setAttribute("data-requests", who.join(" ")); else cell.removeAttribute("data-requests");
      const text = showCount && state === "shared" ? String(ref) : "";
      if (cell.textContent !== text) cell.textContent = text;
      cell.title = describe(i, state, ref, hash, who, pool.cached_hashes_sent);
    }
    drawnStates = states;
    drawnDetails = details;
    if (hovered !== null) showDetail(hovered);
  }

  function showDetail(cell) {
    $("block-detail").textContent = cell.title;
  }

  grid.addEventListener("mouseover", (event) => {
    const cell = event.target.closest(".cell");
    if (!cell) return;
    if (hovered) hovered.classList.remove("selected");
    hovered = cell;
    cell.classList.add("selected");
    showDetail(cell);
  });

  function updateSwap(swap) {
    const frag = document.createDocumentFragment();
    for (const [cpuId, rid] of swap.blocks) {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.dataset.state = "swapped";
      cell.dataset.cpuBlockId = String(cpuId);
      cell.dataset.requests = rid;
      cell.title = `CPU block ${cpuId} · swapped out · request ${rid}`;
      frag.appendChild(cell);
    }
    $("swap-grid").replaceChildren(frag);
    $("swap-info").textContent = swap.num_blocks
      ? `${swap.blocks.length} of ${swap.num_blocks} CPU blocks hold swapped-out sequences`
      : "no swap pool (--swap-space 0)";
  }

  function updateDisk(disk) {
    const bar = $("disk-bar");
    if (!disk) {
      bar.hidden = true;
      $("disk-info").textContent = "none (--kv-offload-dir)";
      return;
    }
    const mib = (n) => (n / 2 ** 20).toFixed(1) + " MiB";
    bar.hidden = false;
    bar.max = disk.capacity_bytes;
    bar.value = disk.bytes;
    $("disk-info").textContent =
      `${disk.num_blocks} blocks on disk, ${mib(disk.bytes)} of ${mib(disk.capacity_bytes)} · ` +
      `${disk.hit_blocks} read back · ${disk.evictions} evicted · ${disk.failed_reads} failed reads`;
  }

  function pct(x) {
    return x === null || x === undefined ? "–" : (100 * x).toFixed(x < 0.1 && x > 0 ? 1 : 0) + "%";
  }

  function td(text, cls) {
    const cell = document.createElement("td");
    if (cls) cell.className = cls;
    cell.textContent = text;
    return cell;
  }

  function seconds(s) {
    return Math.abs(s) < 10 ? s.toFixed(1) + " s" : Math.round(s) + " s";
  }

  function updateRequests(rows, now) {
    const body = document.querySelector("#requests tbody");
    const frag = document.createDocumentFragment();
    for (const r of rows.slice(0, MAX_REQUEST_ROWS)) {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.request_id;
      tr.dataset.queue = r.queue;
      const id = td(r.n > 1 ? `${r.request_id} (n=${r.n})` : r.request_id, "rid");
      id.title = r.request_id;
      tr.appendChild(id);
      const q = document.createElement("td");
      const badge = document.createElement("span");
      badge.className = "queue";
      badge.dataset.queue = r.queue;
      badge.textContent = r.queue;
      q.appendChild(badge);
      tr.appendChild(q);
      const prompt = document.createElement("td");
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = (r.prompt_tokens ? (100 * r.prompt_done) / r.prompt_tokens : 0) + "%";
      bar.appendChild(fill);
      prompt.append(bar, `${r.prompt_done} / ${r.prompt_tokens}`);
      tr.appendChild(prompt);
      tr.appendChild(td(r.max_tokens === null ? String(r.generated) : `${r.generated} / ${r.max_tokens}`));
      tr.appendChild(td(r.swapped_blocks ? `${r.blocks} (+${r.swapped_blocks} on CPU)` : String(r.blocks)));
      tr.appendChild(td(r.cached_tokens ? `${r.cached_tokens} tok` : "–"));
      tr.appendChild(td(String(r.priority)));
      const left = r.ttft_deadline === null ? null : r.ttft_deadline - now;
      tr.appendChild(td(left === null ? "–" : left >= 0 ? `in ${seconds(left)}` : `missed by ${seconds(-left)}`));
      tr.appendChild(td(String(r.preemptions)));
      tr.appendChild(td(r.lora_adapter || "base", "lora"));
      frag.appendChild(tr);
    }
    body.replaceChildren(frag);
    const counts = { running: 0, waiting: 0, swapped: 0 };
    for (const r of rows) counts[r.queue] += 1;
    const more = rows.length > MAX_REQUEST_ROWS ? ` (first ${MAX_REQUEST_ROWS} shown)` : "";
    $("requests-info").textContent =
      `${counts.running} running · ${counts.waiting} waiting · ${counts.swapped} swapped${more}`;
    $("requests-empty").hidden = rows.length > 0;
    $("tile-requests").textContent = `${counts.running} / ${counts.waiting} / ${counts.swapped}`;
  }

  const SVG = "http://www.w3.org/2000/svg";

  // The charts' time window: the history's span once it is full, until then the time it covers (at least
  // MIN_WINDOW_S), so that the first minutes are not squeezed against the right edge.
  const MIN_WINDOW_S = 20;

  function chartWindow(history, now) {
    const first = history.t.length ? history.t[0] : now;
    return Math.min(history.span, Math.max(MIN_WINDOW_S, now - first));
  }

  // One small line chart: time on x over the window, values on y from 0 (to ``max`` or the data's).
  function drawChart(id, history, field, now, opts) {
    const fig = $(id);
    const svg = fig.querySelector("svg");
    const W = 300;
    const H = 70;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const times = history.t;
    const values = history[field];
    let max = opts.max || 0;
    if (!opts.max) for (const v of values) if (v !== null && v > max) max = v;
    max = max || 1;
    const span = chartWindow(history, now);
    const x = (t) => (W * (t - (now - span))) / span;
    const y = (v) => H - 3 - ((H - 6) * v) / max;
    const parts = [];
    let run = [];
    for (let i = 0; i < times.length; i++) {
      if (values[i] === null) {
        if (run.length) parts.push(run);
        run = [];
      } else {
        run.push([x(times[i]), y(values[i])]);
      }
    }
    if (run.length) parts.push(run);
    const nodes = [];
    for (const pts of parts) {
      const line = pts.map(([a, b]) => `${a.toFixed(1)},${b.toFixed(1)}`).join(" ");
      const area = document.createElementNS(SVG, "polygon");
      area.setAttribute("class", "area");
      area.setAttribute("points", `${pts[0][0].toFixed(1)},${H} ${line} ${pts[pts.length - 1][0].toFixed(1)},${H}`);
      const poly = document.createElementNS(SVG, "polyline");
      poly.setAttribute("points", line);
      nodes.push(area, poly);
    }
    svg.replaceChildren(...nodes);
    let latest = null;
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) { latest = values[i]; break; }
    const caption = fig.querySelector("figcaption");
    let b = caption.querySelector("b");
    if (!b) { b = document.createElement("b"); caption.appendChild(b); }
    b.textContent = latest === null ? "–" : opts.fmt(latest);
    fig.dataset.points = String(times.length);
    fig.dataset.nonzero = String(values.filter((v) => v).length);
  }

  function updateCharts(history, now) {
    drawChart("chart-hit", history, "prefix_cache_hit_rate", now, { max: 1, fmt: pct });
    drawChart("chart-usage", history, "kv_usage", now, { max: 1, fmt: pct });
    drawChart("chart-preempt", history, "preemptions", now, { fmt: (v) => String(v) });
    drawChart("chart-tput", history, "throughput", now, { fmt: (v) => v.toFixed(0) });
    const span = chartWindow(history, now);
    const label = span >= 120 ? `${Math.round(span / 60)} min` : `${Math.round(span)} s`;
    $("charts-info").textContent = `last ${label} (up to ${Math.round(history.span / 60)} min), ` +
      `one point per ${history.interval} s`;
  }

  function updateSettings(settings) {
    const key = JSON.stringify(settings);
    if (key === settingsKey) return;
    settingsKey = key;
    const frag = document.createDocumentFragment();
    for (const [name, value] of Object.entries(settings)) {
      const row = document.createElement("div");
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value === null ? "–" : typeof value === "object" ? JSON.stringify(value) : String(value);
      dd.title = dd.textContent;
      row.append(dt, dd);
      frag.appendChild(row);
    }
    $("settings").replaceChildren(frag);
  }

  function render(state) {
    const pool = state.pool;
    updateGrid(pool);
    updateSwap(state.swap);
    updateDisk(state.disk);
    const counts = { ...pool.counts, swapped: state.swap.blocks.length };
    for (const [name, count] of Object.entries(counts)) {
      const el = document.querySelector(`[data-count="${name}"]`);
      if (el) el.textContent = String(count);
    }
    const used = pool.num_blocks - pool.counts.free - pool.counts.cached;
    $("pool-info").textContent =
      `${pool.num_blocks} blocks of ${pool.block_size} tokens · ${used} in use · step ${state.num_steps}`;
    const s = state.stats;
    $("tile-usage").textContent = pct(s.kv_usage);
    $("tile-usage").title = `${used} of ${pool.num_blocks} blocks`;
    $("tile-hit").textContent = pct(s.prefix_cache_queries ? s.prefix_cache_hit_rate : null);
    $("tile-hit").title = `${s.prefix_cache_hits} of ${s.prefix_cache_queries} prompt tokens found (since start)`;
    $("tile-preempt").textContent = String(s.num_preemptions);
    $("tile-preempt").title = `${s.num_swap_outs} by swap, ${s.num_recomputes} by recompute`;
    const tput = state.history.throughput;
    $("tile-tput").textContent = tput.length ? `${tput[tput.length - 1].toFixed(0)} tok/s` : "–";
    updateRequests(state.requests, state.time);
    updateCharts(state.history, state.time);
    updateSettings(state.settings);
    $("model").textContent = state.model;
    document.title = `pagellm · KV cache · ${state.model}`;
    renders += 1;
    document.body.dataset.renders = String(renders);
    document.body.dataset.numSteps = String(state.num_steps);
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.dataset.status = kind;
    el.textContent = text;
  }

  let timer = null;
  let busy = false;

  async function poll() {
    timer = null;
    // No snapshots for a page nobody sees; visibilitychange resumes the polls.
    if (busy || document.hidden) return;
    busy = true;
    try {
      const response = await fetch(STATE_URL, { cache: "no-store", credentials: "same-origin" });
      if (response.status === 401) throw new Error("API key required (reload and give it as the password)");
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const state = await response.json();
      render(state);
      const problem = state.health;
      setStatus(problem ? "error" : "live",
        problem ? problem : `live · ${new Date(state.time * 1000).toLocaleTimeString()}`);
    } catch (error) {
      setStatus("error", `disconnected: ${error.message}`);
    } finally {
      busy = false;
    }
    timer = setTimeout(poll, INTERVAL_MS);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer === null && !busy) poll();
  });
  poll();
})();
