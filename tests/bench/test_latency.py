"""`pagellm bench latency` on a tiny model, pagellm alone: the report's fields and files (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.cli import main
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path

TINY = ["--prompt-len", "8", "24", "--new-tokens", "4", "--runs", "2", "--dtype", "float32",
        "--kv-cache-memory", "64MiB"]


def test_bench_latency_reports_prefill_and_decode_per_prompt_length(llama_path, tmp_path, capsys):
    assert main(["bench", "latency", str(llama_path), *TINY, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "latency-llama.json").read_text())
    assert data["command"] == "latency" and data["backends"] == ["pagellm"] and data["skipped"] == {}
    assert data["dtype"] == "float32" and data["threads"] >= 1 and data["runs"] == 2
    assert data["prompt_lens"] == [8, 24] and data["new_tokens"] == 4
    assert set(data["results"]) == {"8", "24"}
    for res in data["results"].values():
        assert set(res) == {"pagellm"}
        for key in ("prefill_tok_s", "decode_tok_s"):
            stats = res["pagellm"][key]
            assert len(stats["runs"]) == 2 and all(v > 0 for v in stats["runs"])
            assert stats["min"] <= stats["median"] <= stats["max"]
    assert data["ratios"] == {}  # llama.cpp did not run: no ratio
    assert "prefill tok/s" in out and "decode tok/s" in out
    table = (tmp_path / "latency.md").read_text().splitlines()
    assert table[0].startswith("| date | model | pagellm dtype | threads | prompt | new | pagellm prefill tok/s")
    assert len(table) == 4  # header, rule, one row per prompt length
    assert "| llama | float32 |" in table[2] and "| 8 | 4 |" in table[2] and "| 24 | 4 |" in table[3]


@pytest.mark.parametrize("flags,message", [
    (["--backend", "llama.cpp"], "needs a GGUF file"),
    (["--runs", "0"], "--runs must be >= 1"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--prompt-len", "8", "8"], "--prompt-len given twice"),
    (["--backend", "pagellm", "--backend", "pagellm"], "--backend given twice"),
    (["--prompt-len", "100000"], "max_position_embeddings"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bench_latency_refuses_flags_before_any_work(llama_path, tmp_path, capsys, flags, message):
    assert main(["bench", "latency", str(llama_path), *flags, "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(embedded_gguf_path() is None, reason=f"the embedded model is missing: {DEFAULT_MODEL_INSTALL}")
@pytest.mark.slow
def test_bench_latency_runs_the_embedded_default_when_given_no_model(tmp_path, capsys):
    assert main(["bench", "latency", "--backend", "pagellm", "--prompt-len", "8", "--new-tokens", "2", "--runs", "1",
                 "--kv-cache-memory", "64MiB", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"no model given: the embedded default, {embedded_gguf_path()}" in out
    assert "2 new tokens, 1 run, " in out  # one run, not "1 runs"
    data = json.loads((tmp_path / "latency-SmolLM2-135M-Instruct.Q4_1.json").read_text())
    assert data["model"] == "SmolLM2-135M-Instruct.Q4_1" and data["backends"] == ["pagellm"]
