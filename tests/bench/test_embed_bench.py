"""`pagellm bench embed` on a tiny encoder: the corpus, the server at two concurrencies against
sentence-transformers, and well-formed results (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.bench.embed_corpus import stdlib_passages
from pagellm.entrypoints.cli import main
from pagellm.model.default_model import build_encoder_checkpoint


def test_corpus_is_real_text_of_mixed_lengths() -> None:
    passages = stdlib_passages(2000)
    assert len(passages) == 2000 and len(set(passages)) == 2000
    lengths = sorted(map(len, passages))
    assert lengths[0] >= 40 and lengths[-1] > 10 * lengths[len(lengths) // 2]
    assert passages == stdlib_passages(2000)  # the same corpus on every run


def test_bench_embed_writes_results(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sentence_transformers")
    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="mean", max_seq_length=48)
    rc = main(["bench", "embed", str(folder), "--passages", "24", "--runs", "1", "--concurrency", "1", "4",
               "--st-batch-size", "8", "--latency-requests", "3", "--output-dir", str(tmp_path / "out")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "embed.json").read_text())
    assert set(data["medians_passages_s"]) == {"pagellm c=1", "pagellm c=4", "sentence-transformers bs=8"}
    assert data["speedup_vs_sentence_transformers"] > 0 and data["query_p50_ms"] > 0
    assert "llama-server" in data["llama_cpp"] or data["llama_cpp"] == "run"
    assert "one short query" in capfd.readouterr().out
