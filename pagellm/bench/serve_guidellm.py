"""`pagellm bench serve --load-generator guidellm`: guidellm's runs against each server, their
medians over the rounds, and the results written."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pagellm.bench import BenchError
from pagellm.bench import guidellm_load as gl
from pagellm.bench.report import append_markdown_row, line_plot, write_json
from pagellm.bench.serve_client import warm_up_server
from pagellm.bench.serve_launch import Peers, launch_server, plan_server, stop_server
from pagellm.bench.throughput import longest_request
from pagellm.bench.workloads import Workload
from pagellm.model.loader import ModelFiles


def _guidellm_profiles(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """(name, guidellm profile, benchmarks it runs) for the flags: concurrency levels, Poisson rates, sweep."""
    cap = args.max_concurrency or max(args.concurrency or [64])
    profiles: list[tuple[str, dict[str, Any], int]] = []
    if args.concurrency:
        profiles.append(("concurrent", {"kind": "concurrent", "streams": list(args.concurrency)},
                         len(args.concurrency)))
    rates = [r for r in args.request_rate if r != float("inf")]
    if rates:
        profiles.append(("poisson", {"kind": "poisson", "rate": rates, "max_concurrency": cap}, len(rates)))
    if args.sweep_size:
        profiles.append(("sweep", {"kind": "sweep", "sweep_size": args.sweep_size, "strategy_type": "constant",
                                   "max_concurrency": cap}, args.sweep_size))
    return profiles


def run_guidellm(args: argparse.Namespace, servers: list[str], files: ModelFiles, model_name: str, found: Peers,
                  warm_up: tuple[Workload, str]) -> int:
    profiles = _guidellm_profiles(args)
    streams = max([args.max_concurrency or 0, *(args.concurrency or [])]) or 64
    longest = longest_request(args)
    labels = [args.label or "external"] if args.base_url is not None else servers
    raw = args.output_dir / "guidellm"
    rounds: dict[str, list[list[gl.Point]]] = {label: [] for label in labels}
    settings: dict[str, dict[str, Any]] = {}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    planned = sum(n for _, _, n in profiles) * len(labels) * args.repeats
    print(f"guidellm: {planned} benchmarks of {args.duration:.0f} s ({', '.join(p for p, _, _ in profiles)}) over "
          f"{len(labels)} server(s) x {args.repeats} round(s)")
    for r in range(args.repeats):
        for label in labels:
            proc = None
            log_path: Path | None = None
            if args.base_url is not None:
                url, served, ignore_eos = args.base_url, args.served_model_name or model_name, not args.no_ignore_eos
            else:
                plan = plan_server(label, files, args, found, streams, longest)
                settings[label] = plan.settings
                proc, log_path = launch_server(plan, args)
                url, served, ignore_eos = plan.url, plan.served, plan.ignore_eos and not args.no_ignore_eos
            try:
                sampling: dict[str, Any] = {"temperature": 0.0, **({"ignore_eos": True} if ignore_eos else {})}
                warm_up_server(label, url, served, warm_up, args, sampling, headers, log_path)
                points: list[gl.Point] = []
                for k, (name, profile, count) in enumerate(profiles):
                    report_path = raw / f"{label}-{name}-r{r + 1}.json"
                    spec = gl.scenario(url, served, files.folder, profile, args.duration, tuple(args.prompt_len),
                                       tuple(args.output_len), args.seed + k, report_path.absolute(), args.api_key)
                    report = gl.run(spec, raw, raw / f"{label}-r{r + 1}.log",
                                    timeout_s=count * (args.duration * 1.5 + 60) + 300)
                    got = gl.parse_report(report, name)
                    for p in got:
                        print(f"[{label} round {r + 1}] {p.load}: {p.output_tok_s:.1f} out tok/s, TTFT p50 "
                              f"{p.ttft_ms['p50']:.0f} ms, ITL p50 {p.itl_ms['p50']:.1f} ms, {p.completed} ok, "
                              f"{p.errored} failed, {p.incomplete} unfinished"
                              + (f" ({p.errors[0]})" if p.errors else ""))
                    points += got
            finally:
                if proc is not None:
                    stop_server(proc)
            if not any(p.completed for p in points) and not any(p.errored for p in points):
                # A measurement, not a failure: the server was too slow for this load (0 out tok/s); the
                # other servers still run, and the run fails only if none completes anything.
                print(f"warning: no request to the {label} server completed within a benchmark's --duration "
                      f"({args.duration:.0f} s; {sum(p.incomplete for p in points)} still running when time was up)")
            elif not any(p.completed for p in points):
                raise BenchError(f"every request guidellm sent to the {label} server failed; its errors: "
                                 f"{'; '.join(e for p in points for e in p.errors[:1]) or 'none reported'}"
                                 f" (guidellm's output: {raw})")
            rounds[label].append(points)
    if not any(p.completed for rs in rounds.values() for points in rs for p in points):
        raise BenchError(f"no request completed within a benchmark's --duration ({args.duration:.0f} s) on any "
                         "server: give it a longer --duration or shorter requests")
    medians = {label: gl.median_points(rs) for label, rs in rounds.items()}
    print()
    print(gl.table(medians, args.repeats))
    _write_guidellm_results(args, model_name, profiles, medians, rounds, settings)
    return 0


def _write_guidellm_results(args: argparse.Namespace, model_name: str, profiles: list[tuple[str, dict[str, Any], int]],
                            medians: dict[str, list[gl.Point]], rounds: dict[str, list[list[gl.Point]]],
                            settings: dict[str, dict[str, Any]]) -> None:
    out = args.output_dir
    stem = f"serve-guidellm-{model_name}"
    base = gl.ratio_base(list(medians))
    ratios = gl.ratios(medians)
    payload = {
        "command": "serve", "load_generator": "guidellm", "model": model_name,
        "prompt_len": list(args.prompt_len), "output_len": list(args.output_len), "duration_s": args.duration,
        "repeats": args.repeats, "profiles": {name: profile for name, profile, _ in profiles},
        "ratio_base": base, "output_tok_s_ratios": ratios,
        "servers": {label: {"settings": settings.get(label, {}), "median": [gl.point_dict(p) for p in points],
                            "rounds": [[gl.point_dict(p) for p in rnd] for rnd in rounds[label]]}
                    for label, points in medians.items()},
    }
    print(f"wrote {write_json(out / f'{stem}.json', payload)}")
    prompt = "-".join(str(n) for n in sorted(set(args.prompt_len)))
    output = "-".join(str(n) for n in sorted(set(args.output_len)))
    for label, points in medians.items():
        for p in points:
            if not p.completed:
                continue
            x = ratios.get(label, {}).get(p.key)
            append_markdown_row(
                out / "serve-guidellm.md",
                ["date", "server", "model", "prompt/output tokens", "load", "runs", "out tok/s", f"x {base}",
                 "req/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms",
                 "ok", "failed", "unfinished"],
                [time.strftime("%Y-%m-%d"), label, model_name, f"{prompt}/{output}", p.load, args.repeats,
                 p.output_tok_s, "-" if x is None else f"{x:.2f}", p.requests_per_s, p.ttft_ms["p50"],
                 p.ttft_ms["p90"], p.ttft_ms["p99"], p.itl_ms["p50"], p.itl_ms["p90"], p.itl_ms["p99"], p.completed,
                 p.errored, p.incomplete])
    print(f"wrote {out / 'serve-guidellm.md'}")
    concurrent = {label: [p for p in points if p.kind == "concurrent" and p.streams]
                  for label, points in medians.items()}
    if any(concurrent.values()):
        for what, unit, value in (("throughput", "output tokens/s", lambda p: p.output_tok_s),
                                  ("ttft", "TTFT p50 (ms)", lambda p: p.ttft_ms["p50"]),
                                  ("itl", "ITL p50 (ms)", lambda p: p.itl_ms["p50"])):
            plot = line_plot(out / f"{stem}-concurrency-{what}.png",
                             {label: ([float(p.streams or 0) for p in ps], [value(p) for p in ps])
                              for label, ps in concurrent.items() if ps},
                             "concurrent streams", unit,
                             f"{unit}, median of {args.repeats} run(s)", log_x=True)
            if plot is not None:
                print(f"wrote {plot}")
    by_rate = {label: sorted((p for p in points if p.kind != "concurrent"), key=lambda p: p.output_tok_s)
               for label, points in medians.items()}
    if any(by_rate.values()):
        plot = line_plot(out / f"{stem}-rates.png",
                         {label: ([p.output_tok_s for p in ps], [p.ttft_ms["p50"] for p in ps])
                          for label, ps in by_rate.items() if ps},
                         "output tokens/s", "TTFT p50 (ms)", "TTFT against throughput, rate runs")
        if plot is not None:
            print(f"wrote {plot}")
