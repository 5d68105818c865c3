"""The pooling server's dashboard: ``GET /dashboard``, a page that polls ``GET /v1/pooling/stats`` (requests/s,
inputs/s, tokens/s and latency percentiles over the last minute, totals by route kind) once a second."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from pagellm.engine.pooling_metrics import PoolingMetrics

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>pagellm pooling</title>
<style>body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{padding:.3em 1em;border-bottom:1px solid #ddd;text-align:left}th{color:#666;font-weight:normal}
.v{font-variant-numeric:tabular-nums;font-weight:600}</style></head>
<body><h2>pagellm pooling server: <span id="model"></span></h2>
<p>Over the last <span id="window"></span> s, refreshed every second.</p>
<table id="t"></table>
<script>
const rows = [["requests/s", s => s.requests_per_s.toFixed(2)], ["inputs/s", s => s.inputs_per_s.toFixed(2)],
  ["tokens/s", s => s.tokens_per_s.toFixed(1)],
  ["latency p50 / p90 / p99 (ms)", s => ["p50", "p90", "p99"].map(k => s.latency_ms[k] == null ? "-" :
    s.latency_ms[k].toFixed(1)).join(" / ")],
  ["requests (errors)", s => s.requests_total + " (" + s.errors_total + ")"],
  ["inputs, tokens", s => s.inputs_total + ", " + s.tokens_total],
  ["by kind", s => Object.entries(s.requests_by_kind).map(([k, n]) => k + " " + n).join(", ") || "-"]];
async function tick() {
  try {
    const r = await fetch("v1/pooling/stats"); const s = await r.json();
    document.getElementById("model").textContent = s.model;
    document.getElementById("window").textContent = s.window_s;
    document.getElementById("t").innerHTML = rows.map(([name, f]) =>
      "<tr><th>" + name + "</th><td class=v>" + f(s) + "</td></tr>").join("");
  } catch (e) { document.getElementById("t").innerHTML = "<tr><td>" + e + "</td></tr>"; }
}
tick(); setInterval(tick, 1000);
</script></body></html>
"""


def add_pooling_dashboard(app: FastAPI, metrics: PoolingMetrics) -> None:
    @app.get("/v1/pooling/stats")
    async def pooling_stats() -> dict[str, Any]:
        return metrics.stats()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_PAGE)
