"""guidellm as the load generator of `pagellm bench serve` (``--load-generator guidellm``).

guidellm (``guidellm==0.8.1``, the ``peers`` extra) is the vLLM project's load generator: it sends
synthetic prompts of the workload's lengths through a streamed ``/v1/completions`` API and measures
each request. Per server the bench runs it for

- fixed concurrency: ``--concurrency 1,8,24,64`` streams, each level for ``--duration`` seconds;
- fixed Poisson rates (``--request-rate R ...``): the same rates for every server, so comparable;
- guidellm's adaptive rate sweep (``--sweep-size N``): synchronous, then as fast as it goes, then N - 2
  constant rates between the two; each server's own rates (its latency against its throughput), so
  listed but not set against another server's.

Every benchmark of guidellm's JSON report becomes a :class:`Point`: output tokens/s and requests/s
(guidellm's: what arrived inside the measured window, over its length), and the p50/p90/p99
of time to first token and of inter-token latency (ms, over the successful requests). ``--repeats N``
runs everything N times (the servers in turn within each round); the median of each number over the
rounds is what is reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench import BenchError

INSTALL = "pip install 'pagellm[peers]' (make install-peers): guidellm==0.8.1"
PERCENTILES = ("p50", "p90", "p99")


def guidellm_command() -> list[str]:
    """How to run guidellm: the module beside this interpreter; ValueError saying how to install it."""
    if importlib.util.find_spec("guidellm") is None:
        raise ValueError(f"--load-generator guidellm needs guidellm, which is not installed here: {INSTALL}")
    return [sys.executable, "-m", "guidellm"]


def parse_concurrency(text: str) -> list[int]:
    """``--concurrency 1,8,24,64``: stream counts, each >= 1 (an argparse ``type``)."""
    import argparse

    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of stream counts, "
                                         "e.g. 1,8,24,64") from None
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: give stream counts >= 1, e.g. 1,8,24,64")
    return levels


@dataclass
class Point:
    """One guidellm benchmark (one concurrency level or one rate) against one server."""

    key: str  # "concurrent@8", "poisson@2", "sweep#3": the same load across servers and rounds
    kind: str  # guidellm's strategy type: concurrent, poisson, synchronous, throughput, constant
    streams: int | None
    rate: float | None  # requests/s asked for (rate strategies)
    completed: int
    errored: int
    incomplete: int  # still running when the benchmark's time was up (not measured)
    duration_s: float
    output_tok_s: float
    requests_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)  # mean, p50, p90, p99
    itl_ms: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def load(self) -> str:
        """The load in words, for tables."""
        if self.kind == "concurrent":
            return f"{self.streams} stream" + ("s" if self.streams != 1 else "")
        if self.kind in ("poisson", "constant") and self.rate is not None:
            return f"{self.kind} {self.rate:.3g} req/s" + (f" ({self.key})" if self.key.startswith("sweep") else "")
        return f"{self.kind} ({self.key})" if self.key.startswith("sweep") else self.kind


def _dist(metric: dict[str, Any]) -> dict[str, float]:
    """mean and p50/p90/p99 of guidellm's distribution summary over the successful requests."""
    ok = metric.get("successful") or {}
    pct = ok.get("percentiles") or {}
    return {"mean": float(ok.get("mean") or 0.0), **{p: float(pct.get(p) or 0.0) for p in PERCENTILES}}


def parse_report(report: dict[str, Any], profile: str) -> list[Point]:
    """guidellm's JSON report (``--output kind=json``) as points. ``profile``: what was asked of it
    ("concurrent", "poisson", "sweep"), which names the points. ValueError on a report of another shape."""
    try:
        benchmarks = report["benchmarks"]
        points = []
        for index, b in enumerate(benchmarks):
            if b is None:  # a benchmark guidellm could not serialise
                continue
            strategy = b["config"]["strategy"]
            kind = strategy["type_"]
            metrics = b["metrics"]
            totals = metrics["request_totals"]
            streams = strategy.get("streams") if kind == "concurrent" else None
            rate = strategy.get("rate")
            if profile == "sweep":
                key = f"sweep#{index + 1}"
            elif kind == "concurrent":
                key = f"concurrent@{streams}"
            else:
                key = f"{kind}@{rate:g}" if rate is not None else kind
            errors = sorted({str((r.get("info") or {}).get("error")) for r in b["requests"].get("errored", [])
                             if (r.get("info") or {}).get("error")})[:5]
            points.append(Point(
                key=key, kind=kind, streams=streams, rate=float(rate) if rate is not None else None,
                completed=int(totals["successful"]), errored=int(totals["errored"]),
                incomplete=int(totals.get("incomplete") or 0), duration_s=float(b["duration"]),
                output_tok_s=float(metrics["output_tokens_per_second"]["successful"]["mean"]),
                requests_per_s=float(metrics["requests_per_second"]["successful"]["mean"]),
                ttft_ms=_dist(metrics["time_to_first_token_ms"]), itl_ms=_dist(metrics["inter_token_latency_ms"]),
                errors=errors))
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"guidellm's report is not the shape guidellm 0.8.1 writes ({type(e).__name__}: {e})") from e
    return points


def median_points(rounds: list[list[Point]]) -> list[Point]:
    """Per load (key), the median of each number over the rounds that measured it (in the first
    round's order); the errors of every round."""
    by_key: dict[str, list[Point]] = {}
    for points in rounds:
        for p in points:
            by_key.setdefault(p.key, []).append(p)

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    out = []
    for key, ps in by_key.items():
        first = ps[0]
        rates = [p.rate for p in ps if p.rate is not None]
        out.append(Point(
            key=key, kind=first.kind, streams=first.streams, rate=med(rates) if rates else None,
            completed=round(med([p.completed for p in ps])), errored=round(med([p.errored for p in ps])),
            incomplete=round(med([p.incomplete for p in ps])),
            duration_s=med([p.duration_s for p in ps]), output_tok_s=med([p.output_tok_s for p in ps]),
            requests_per_s=med([p.requests_per_s for p in ps]),
            ttft_ms={k: med([p.ttft_ms[k] for p in ps]) for k in first.ttft_ms},
            itl_ms={k: med([p.itl_ms[k] for p in ps]) for k in first.itl_ms},
            errors=sorted({e for p in ps for e in p.errors})[:5]))
    return out


def scenario(target: str, model: str, tokenizer: Path, profile: dict[str, Any], duration_s: float,
             prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int, output: Path,
             api_key: str | None = None) -> dict[str, Any]:
    """guidellm's scenario (its ``-c`` file) for one profile against one server: streamed
    ``/v1/completions`` (no chat template: every server sees the same text), synthetic prompts of
    ``prompt_len`` tokens asking for exactly ``output_len`` new ones (guidellm sends ``ignore_eos``),
    ``duration_s`` per benchmark with its first and last 10% left out of the measurement."""
    def lengths(name: str, low: int, high: int) -> dict[str, int]:
        if low == high:
            return {name: low}
        # Uniform on [low, high] has this mean and standard deviation; guidellm draws a clipped normal.
        return {name: (low + high) // 2, f"{name}_stdev": max(1, round((high - low) / 12 ** 0.5)),
                f"{name}_min": low, f"{name}_max": high}

    backend: dict[str, Any] = {"kind": "openai_http", "target": target, "model": model,
                               "request_format": "/v1/completions", "timeout": 600.0}
    if api_key:
        backend["api_key"] = api_key
    return {"spec": {
        "backend": backend,
        "profile": {**profile, "warmup": 0.1, "cooldown": 0.1},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", **lengths("prompt_tokens", *prompt_len),
                  **lengths("output_tokens", *output_len)}],
        "constraints": [{"kind": "max_duration", "seconds": duration_s}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(output)}],
    }}


def run(spec: dict[str, Any], workdir: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run guidellm on ``spec`` (from :func:`scenario`); its JSON report. BenchError where it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    scenario_path = workdir / (Path(spec["spec"]["outputs"][0]["path"]).stem + ".scenario.json")
    scenario_path.write_text(json.dumps(spec, indent=1))
    report_path = Path(spec["spec"]["outputs"][0]["path"])
    report_path.unlink(missing_ok=True)
    # One worker process, started by a fork server: guidellm's default of one per core (spawned) costs
    # the server under test CPU time on a small machine, and one process drives 64 streams.
    env = {**os.environ, "GUIDELLM__MP_CONTEXT_TYPE": "forkserver"}
    env.setdefault("GUIDELLM__MAX_WORKER_PROCESSES", "1")
    with open(log_path, "ab") as log:
        try:
            done = subprocess.run([*guidellm_command(), "run", "-c", str(scenario_path), "--disable-console"],
                                  cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"guidellm ran past {timeout_s:.0f} s; its output is in {log_path}") from None
    if done.returncode != 0 or not report_path.is_file():
        raise BenchError(f"guidellm failed (exit status {done.returncode}); its output is in {log_path}")
    try:
        data = json.loads(report_path.read_text())
    except json.JSONDecodeError as e:
        raise BenchError(f"guidellm's report {report_path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BenchError(f"guidellm's report {report_path} is not a JSON object")
    return data


def point_dict(p: Point) -> dict[str, Any]:
    return {**asdict(p), "load": p.load}


def ratio_base(servers: list[str]) -> str:
    """The server the others are set against: pagellm where it ran, else the first."""
    return "pagellm" if "pagellm" in servers else servers[0]


def comparable(p: Point) -> bool:
    """Whether ``p``'s load is the same for every server (not one of a sweep's own rates)."""
    return not p.key.startswith("sweep")


def table(medians: dict[str, list[Point]], repeats: int) -> str:
    """The text table: a row per server and load, output tok/s with its ratio to the base server's at
    the same load, TTFT and ITL percentiles."""
    servers = list(medians)
    base = ratio_base(servers)
    base_by_key = {p.key: p for p in medians.get(base, [])}
    head = (f"{'server':<14} {'load':<26} {'out tok/s':>9} {'x ' + base:>11} {'req/s':>6} "
            f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'ok':>5} {'fail':>5} "
            f"{'unfin':>5}")
    lines = [f"median of {repeats} run{'s' if repeats != 1 else ''}; latencies in ms; x {base}: output tok/s over "
             f"{base}'s at the same load; ok/fail/unfin: requests measured, failed, still running at the end "
             "(not counted)", head, "-" * len(head)]
    for server in servers:
        for p in medians[server]:
            b = base_by_key.get(p.key)
            x = (f"{p.output_tok_s / b.output_tok_s:.2f}" if b is not None and b.output_tok_s > 0 and comparable(p)
                 else "-")
            done = p.completed > 0  # latencies of no finished request: shown as '-', not 0
            ttft = [f"{p.ttft_ms[q]:.0f}" if done else "-" for q in ("p50", "p90", "p99")]
            itl = [f"{p.itl_ms[q]:.1f}" if done else "-" for q in ("p50", "p90", "p99")]
            lines.append(f"{server:<14} {p.load:<26} {p.output_tok_s:>9.1f} {x:>11} {p.requests_per_s:>6.2f} "
                         f"{ttft[0]:>9} {ttft[1]:>8} {ttft[2]:>8} {itl[0]:>8} {itl[1]:>7} {itl[2]:>7} {p.completed:>5} "
                         f"{p.errored:>5} {p.incomplete:>5}")
    return "\n".join(lines)


def ratios(medians: dict[str, list[Point]]) -> dict[str, dict[str, float]]:
    """server -> load key -> its output tok/s over the base server's (comparable loads only)."""
    base = ratio_base(list(medians))
    base_by_key = {p.key: p for p in medians.get(base, [])}
    out: dict[str, dict[str, float]] = {}
    for server, points in medians.items():
        for p in points:
            b = base_by_key.get(p.key)
            if b is not None and b.output_tok_s > 0 and comparable(p):
                out.setdefault(server, {})[p.key] = p.output_tok_s / b.output_tok_s
    return out
