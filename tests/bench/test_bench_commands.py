"""Each benchmark command runs on a tiny workload and writes well-formed results (no timing asserts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pagellm.bench.serve import parse_goodput
from pagellm.entrypoints.cli import main

TINY = ["--model-preset", "tiny-llama", "--dtype", "float32", "--num-prompts", "4", "--prompt-len", "8", "24",
        "--output-len", "4", "12", "--kv-cache-memory", "64MiB"]


def test_bench_throughput_writes_json_markdown_and_plot(tmp_path, capfd):
    rc = main(["bench", "throughput", *TINY, "--backend", "pagellm", "--backend", "hf", "--backend", "hf-batched",
               "--hf-batch-sizes", "2", "4", "--output-dir", str(tmp_path)])
    assert rc == 0
    captured = capfd.readouterr()
    out = captured.out
    assert "pagellm" in out and "hf-batched" in out and "efficiency" in out
    data = json.loads((tmp_path / "throughput-random-tiny-llama.json").read_text())
    # Each backend: its own progress bar, and a line whose seconds are the JSON's elapsed_s.
    for backend, total in (("pagellm", 4), ("hf", 4), ("hf-batched", 8)):
        assert re.search(rf"{backend}: 100%.*\| {total}/{total}", captured.err), captured.err
        elapsed = data["results"][backend]["elapsed_s"]
        measured = "the best batch size's run" if backend == "hf-batched" else "the workload"
        assert f"  {backend}: {elapsed:.2f} s for {measured} (elapsed_s)" in out
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


@pytest.mark.slow
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


@pytest.mark.peers  # transformers serve's streaming changes between releases
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


@pytest.mark.parametrize("command, flags, message", [
    ("throughput", ["--prompt-len", "8", "4"], "--prompt-len MIN MAX needs 1 <= MIN <= MAX, got 8 4"),
    ("memory", ["--output-len", "-2", "3"], "--output-len MIN MAX needs 1 <= MIN <= MAX, got -2 3"),
    ("serve", ["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    ("throughput", ["--seed", str(2**64)], "--seed must be an integer in"),
    ("throughput", ["--workload", "shared-prefix", "--prefix-len", "-5"], "--prefix-len must be >= 1"),
    ("throughput", ["--max-num-batched-tokens", "0"], "(--max-num-batched-tokens) must be a positive integer"),
    ("throughput", ["--max-num-batched-tokens", "8"], "max_num_batched_tokens (8) is smaller than max_num_seqs (256)"),
    ("throughput", ["--hf-batch-sizes", "-1"], "--hf-batch-sizes must all be >= 1"),
    ("throughput", ["--backend", "pagellm", "--backend", "pagellm"], "--backend given twice"),
    ("throughput", ["--prompt-len", "3000", "5000"],
     "the longest request is 5012 tokens (--prompt-len MAX + --output-len MAX), "
     "more than tiny-llama's max_position_embeddings"),
    ("throughput", ["--model", "/nonexistent/model"], "does not exist"),
    ("memory", ["--max-model-len", "0"], "--max-model-len 0 is shorter than the workload's longest request"),
    ("memory", ["--max-model-len", "100000000"], "more than tiny-llama's max_position_embeddings"),
    ("serve", ["--workload", "parallel"], "the parallel workload (n > 1) is measured by"),
    ("serve", ["--base-url", "http://127.0.0.1:9", "--block-size", "8"],
     "--block-size, --kv-cache-memory: engine flags of a server bench serve launches"),
    ("serve", ["--server", "transformers"], "--kv-cache-memory: engine flags of a launched pagellm server"),
    ("serve", ["--goodput"], "--goodput needs at least one KEY:MS"),
    ("serve", ["--goodput", "ttft:-5"], "the limit must be a positive number of milliseconds"),
    ("serve", ["--goodput", "ttft:abc"], "the limit must be a positive number of milliseconds"),
])
def test_bench_flags_are_refused_before_any_work(tmp_path, capsys, command, flags, message):
    assert main(["bench", command, *TINY, *flags, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # a refused run leaves nothing behind


def test_bench_output_dir_that_cannot_be_created_is_refused_first(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["bench", "memory", *TINY, "--output-dir", str(tmp_path / "afile")]) == 2
    assert "--output-dir" in (err := capsys.readouterr().err) and "cannot be created" in err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_bench_serve_rejects_a_request_rate_that_is_not_positive(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *TINY, f"--request-rate={value}", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "is not a request rate" in capsys.readouterr().err


def test_bench_serve_against_nothing_is_a_one_line_error(tmp_path, capsys):
    from pagellm.entrypoints.openai.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"
    workload = TINY[:2] + TINY[4:-2]  # no flags for a server to launch: a --base-url server has its own
    assert main(["bench", "serve", *workload, "--base-url", url, "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "pagellm: error: the external server at" in err and "failed the warm-up request" in err
    assert "Traceback" not in err


def test_bench_serve_where_every_request_fails_measures_nothing_and_says_so(tmp_path, capsys):
    from pagellm.bench.workloads import bench_model_path
    from tests.entrypoints.openai.server_utils import RemoteServer

    srv = RemoteServer(bench_model_path("tiny-llama", "bfloat16"),
                       ["--max-model-len", "64", "--served-model-name", "tiny-llama", "--kv-cache-memory", "16MiB"])
    try:
        # Prompts longer than the server's max_model_len: every measured request gets a 400.
        rc = main(["bench", "serve", "--model-preset", "tiny-llama", "--num-prompts", "2", "--prompt-len", "100",
                   "120", "--output-len", "2", "4", "--base-url", srv.url, "--output-dir", str(tmp_path)])
    finally:
        srv.stop()
    err = capsys.readouterr().err
    assert rc == 1 and "every request to the external server failed" in err and "maximum context length" in err
    assert not list(tmp_path.glob("serve-*.json"))


def test_engine_flags_at_their_usual_values_are_still_refused_with_base_url(tmp_path, capsys):
    workload = TINY[:2] + TINY[4:-2]
    assert main(["bench", "serve", *workload, "--base-url", "http://127.0.0.1:9", "--max-num-seqs", "256",
                 "--output-dir", str(tmp_path)]) == 2
    assert "--max-num-seqs: engine flags of a server bench serve launches" in capsys.readouterr().err


def test_a_launched_pagellm_server_gets_the_engine_flags():
    from pagellm.bench.serve import resolve_engine_flags
    from pagellm.bench.serve_launch import pagellm_command
    from pagellm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"])
    resolve_engine_flags(args, ["pagellm"])
    cmd = pagellm_command("/m", 9000, args)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8" and cmd[cmd.index("--max-num-batched-tokens") + 1] == "512"
    assert cmd[cmd.index("--block-size") + 1] == "16" and cmd[cmd.index("--kv-cache-memory") + 1] == "2GiB"


@pytest.mark.slow
def test_without_matplotlib_the_results_are_written_and_the_plots_skipped(tmp_path):
    # A matplotlib that cannot be imported, first on the path: as on an install without the bench extra.
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MPLBACKEND", None)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "throughput", *TINY,
                        "--backend", "pagellm", "--output-dir", str(out)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "matplotlib is not installed: results and tables will be written, plots skipped" in r.stdout
    assert (out / "throughput-random-tiny-llama.json").is_file() and (out / "throughput.md").is_file()
    assert not list(out.glob("*.png"))
