"""Each benchmark command runs on a tiny workload and writes well-formed results (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from pagellm.bench.serve import parse_goodput
from pagellm.entrypoints.cli import main

TINY = ["--model-preset", "tiny-llama", "--dtype", "float32", "--num-prompts", "4", "--prompt-len", "8", "24",
        "--output-len", "4", "12", "--kv-cache-memory", "64MiB"]


def test_bench_throughput_writes_json_markdown_and_plot(tmp_path, capsys):
    rc = main(["bench", "throughput", *TINY, "--backend", "pagellm", "--backend", "hf", "--backend", "hf-batched",
               "--hf-batch-sizes", "2", "4", "--output-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pagellm" in out and "hf-batched" in out and "efficiency" in out
    data = json.loads((tmp_path / "throughput-random-tiny-llama.json").read_text())
    assert set(data["results"]) == {"pagellm", "hf", "hf-batched"}
    for r in data["results"].values():
        assert r["output_tokens"] == data["workload"]["output_tokens"] and r["output_tokens_per_s"] > 0
    assert data["results"]["hf-batched"]["detail"]["best_batch_size"] in (2, 4)
    assert set(data["ratios_output_tokens_per_s"]) == {"hf", "hf-batched"}
    assert 0 < data["decode_roofline"]["decode_efficiency"] <= 1.5
    assert data["machine_limits"]["copy_bandwidth_gbs"] > 0
    table = (tmp_path / "throughput.md").read_text().splitlines()
    assert table[0].startswith("| date | workload") and len(table) == 3
    assert (tmp_path / "throughput-random-tiny-llama.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_throughput_shared_prefix_reports_ttft_with_and_without_cache(tmp_path):
    rc = main(["bench", "throughput", *TINY, "--workload", "shared-prefix", "--prefix-len", "1000",
               "--backend", "pagellm", "--output-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "throughput-shared-prefix-tiny-llama.json").read_text())
    assert "pagellm-no-prefix-cache" in data["results"]
    assert data["ttft_speedup_from_prefix_cache"] > 0
    assert data["results"]["pagellm"]["detail"]["prefix_cache_hit_rate"] > 0


def test_bench_memory_reports_paged_vs_contiguous(tmp_path, capsys):
    # Equal output lengths: all 4 requests run together and end in the same step, so the peak holds 4.
    rc = main(["bench", "memory", *TINY, "--output-len", "8", "8", "--output-dir", str(tmp_path),
               "--max-model-len", "512"])
    assert rc == 0
    data = json.loads((tmp_path / "memory-random-tiny-llama.json").read_text())
    assert data["paged_peak_bytes"] < data["contiguous_reservation_bytes"]
    assert 0 <= data["fragmentation_at_peak"] < 1
    assert data["sequences_at_peak"] == 4
    assert data["contiguous_reservation_bytes"] == (data["sequences_at_peak"] * data["contiguous_max_model_len"]
                                                    * data["kv_bytes_per_token"])
    assert data["max_concurrent_paged"] > data["max_concurrent_contiguous"]
    assert (tmp_path / "memory-random-tiny-llama-kv-usage.png").read_bytes()[:4] == b"\x89PNG"
    assert "fragmentation at peak" in capsys.readouterr().out


def test_bench_serve_against_a_launched_server(tmp_path, capsys):
    rc = main(["bench", "serve", *TINY, "--request-rate", "20", "inf", "--max-concurrency", "4",
               "--goodput", "ttft:60000", "tpot:60000", "--temperature", "0.7", "--output-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "serve-pagellm-random-tiny-llama.json").read_text())
    assert set(data["results"]) == {"20.0", "inf"} and data["temperature"] == 0.7
    # Fresh requests per rate: a prefix cache never sees a prompt twice.
    assert [data["results"][r]["workload_seed"] for r in ("20.0", "inf")] == [0, 1]
    for summary in data["results"].values():
        assert summary["completed"] == 4 and summary["failed"] == 0
        assert summary["ttft"]["median_ms"] > 0 and summary["e2el"]["p99_ms"] >= summary["ttft"]["p99_ms"]
        assert summary["goodput_requests_per_s"] == pytest.approx(summary["request_throughput"])
    assert len((tmp_path / "serve.md").read_text().splitlines()) == 4
    assert (tmp_path / "serve-pagellm-random-tiny-llama-latency.png").exists()


def test_bench_serve_sends_the_same_requests_to_pagellm_and_transformers_serve(tmp_path, capsys):
    rc = main(["bench", "serve", *TINY, "--server", "pagellm", "--server", "transformers", "--request-rate", "inf",
               "--output-dir", str(tmp_path)])
    assert rc == 0
    for label in ("pagellm", "transformers"):
        summary = json.loads((tmp_path / f"serve-{label}-random-tiny-llama.json").read_text())["results"]["inf"]
        assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
        assert summary["ttft"]["median_ms"] > 0 and summary["output_token_throughput"] > 0
    assert "pagellm" in capsys.readouterr().out.splitlines()[-1]  # the comparison line
    assert len((tmp_path / "serve.md").read_text().splitlines()) == 4  # header, rule, one row per server


@pytest.mark.parametrize("flags,message", [
    (["--server", "pagellm", "--base-url", "http://127.0.0.1:9"], "give one of them"),
    (["--label", "mine"], "--label names a --base-url server"),
    (["--server", "pagellm", "--server", "pagellm"], "given twice"),
])
def test_bench_serve_rejects_conflicting_flags(tmp_path, capsys, flags, message):
    assert main(["bench", "serve", *TINY, *flags, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["3", "-0.5", "nan"])
def test_bench_serve_rejects_a_temperature_outside_the_api_range(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        main(["bench", "serve", *TINY, "--temperature", value, "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{value} is not a temperature in [0, 2]" in capsys.readouterr().err


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:5"])
