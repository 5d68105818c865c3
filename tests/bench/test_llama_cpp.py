"""llama.cpp as a benchmark peer: skipped, saying how to install it, where llama-cpp-python is missing;
refused on a Hugging Face folder; and (peers) a real run on the SmolLM2 GGUF beside pagellm."""

from __future__ import annotations

import json
import sys

import pytest

from pagellm.bench import llama_cpp, throughput
from pagellm.bench.roofline import MachineLimits
from pagellm.entrypoints.cli import main
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path

HINT = "pip install 'pagellm[llama]'"
WORKLOAD = ["--num-prompts", "2", "--prompt-len", "8", "16", "--output-len", "4", "8", "--dtype", "float32",
            "--kv-cache-memory", "64MiB"]


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """llama-cpp-python as if it were not installed: its import fails."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


@pytest.fixture
def tiny_gguf(llama_path, tmp_path):
    from tests.model.gguf_writer import write_gguf

    return write_gguf(llama_path, tmp_path / "tiny.gguf")


@pytest.fixture
def machine(monkeypatch):
    """The machine's limits, not measured (seconds of matmuls and copies the tests here do not read)."""
    monkeypatch.setattr(throughput, "measure_machine", lambda: MachineLimits(1.0, 1.0, 10.0))


def test_a_missing_llama_cpp_python_names_the_extra(no_llama_cpp):
    why = llama_cpp.unavailable()
    assert why is not None and "llama-cpp-python is not installed" in why and HINT in why


def test_throughput_skips_llama_cpp_when_it_is_missing(no_llama_cpp, machine, tiny_gguf, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_gguf), *WORKLOAD, "--backend", "llama.cpp",
               "--output-dir", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"llama.cpp: skipped (llama-cpp-python is not installed: {HINT}" in out
    data = json.loads((tmp_path / "out" / "throughput-random-tiny.json").read_text())
    assert HINT in data["results"]["llama.cpp"]["skipped"]


def test_latency_on_a_gguf_file_runs_pagellm_and_skips_a_missing_llama_cpp(no_llama_cpp, tiny_gguf, tmp_path,
                                                                           capsys):
    rc = main(["bench", "latency", str(tiny_gguf), "--prompt-len", "8", "--new-tokens", "3", "--runs", "1",
               "--dtype", "float32", "--kv-cache-memory", "64MiB", "--output-dir", str(tmp_path / "out")])
    assert rc == 0
    assert f"llama.cpp: skipped (llama-cpp-python is not installed: {HINT}" in capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "latency-tiny.json").read_text())
    assert data["backends"] == ["pagellm"] and HINT in data["skipped"]["llama.cpp"]
    assert data["results"]["8"]["pagellm"]["decode_tok_s"]["median"] > 0
    row = (tmp_path / "out" / "latency.md").read_text().splitlines()[2]
    assert row.endswith("| - | - |")  # llama.cpp's decode and the ratio: not measured


def test_latency_with_llama_cpp_alone_and_missing_says_so(no_llama_cpp, tiny_gguf, tmp_path, capsys):
    rc = main(["bench", "latency", str(tiny_gguf), "--backend", "llama.cpp", "--output-dir", str(tmp_path)])
    assert rc == 1
    assert f"no backend could run: llama.cpp: llama-cpp-python is not installed: {HINT}" in capsys.readouterr().err


@pytest.mark.parametrize("model", [None, "folder"])
def test_throughput_refuses_llama_cpp_without_a_gguf_file(llama_path, tmp_path, capsys, model):
    flags = ["--model", str(llama_path)] if model else ["--model-preset", "tiny-llama"]
    rc = main(["bench", "throughput", *flags, *WORKLOAD, "--backend", "llama.cpp", "--output-dir", str(tmp_path)])
    assert rc == 2
    assert "--backend llama.cpp needs a GGUF file" in capsys.readouterr().err


def test_throughput_skips_transformers_on_a_gguf_file(machine, tiny_gguf, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_gguf), *WORKLOAD, "--backend", "hf",
               "--output-dir", str(tmp_path)])
    assert rc == 0
    assert "hf: skipped (transformers reads a Hugging Face folder, not a GGUF file)" in capsys.readouterr().out


SMOLLM2 = embedded_gguf_path()


@pytest.mark.peers
@pytest.mark.skipif(SMOLLM2 is None, reason=f"the SmolLM2 GGUF is not installed ({DEFAULT_MODEL_INSTALL})")
def test_llama_cpp_and_pagellm_on_the_smollm2_gguf(machine, tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason=f"llama-cpp-python is not installed ({HINT}, or make install-llama)")
    rc = main(["bench", "latency", str(SMOLLM2), "--prompt-len", "32", "--new-tokens", "8", "--runs", "1",
               "--dtype", "float32", "--kv-cache-memory", "256MiB", "--output-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / f"latency-{SMOLLM2.stem}.json").read_text())
    assert data["backends"] == ["pagellm", "llama.cpp"] and data["skipped"] == {}
    assert data["llama_cpp"]["llama_cpp_python"] and data["llama_cpp"]["n_threads"] == data["threads"]
    for backend in ("pagellm", "llama.cpp"):
        for key in ("prefill_tok_s", "decode_tok_s"):
            assert data["results"]["32"][backend][key]["median"] > 0
    assert set(data["ratios"]["32"]) == {"prefill_tok_s_pagellm_over_llama_cpp", "decode_tok_s_pagellm_over_llama_cpp"}

    rc = main(["bench", "throughput", "--model", str(SMOLLM2), *WORKLOAD, "--output-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / f"throughput-random-{SMOLLM2.stem}.json").read_text())
    assert set(data["results"]) == {"pagellm", "llama.cpp"}  # the default backends on a GGUF file
    for r in data["results"].values():
        assert r["skipped"] is None and r["output_tokens"] == data["workload"]["output_tokens"]
    assert data["ratios_output_tokens_per_s"]["llama.cpp"] > 0
