"""The rag workload (questions about long documents) and `bench throughput --workload rag`, whose runs each
start a process of their own on a KV tier on disk."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from pagellm.bench.rag_workload import rag_workload
from pagellm.entrypoints.cli import main


def test_rag_prompts_are_a_document_then_a_question(llama_path):
    tokenizer = AutoTokenizer.from_pretrained(str(llama_path))
    w = rag_workload(tokenizer, num_requests=12, num_docs=4, doc_range=(200, 300), answer_len=8, seed=3)
    assert w.num_requests == 12 and w.output_lens == [8] * 12
    assert sorted(w.meta["doc_of"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(200 <= n <= 300 for n in w.meta["doc_tokens"])
    head = w.meta["prefix_tokens"]
    for d in range(4):
        asks = [p for p, doc in zip(w.prompts, w.meta["doc_of"]) if doc == d]
        # Every question about a document starts with the same tokens (what the KV cache keeps), and
        # asks something of its own after them.
        shared = head + w.meta["doc_tokens"][d]
        assert all(p[:shared] == asks[0][:shared] for p in asks) and len({tuple(p[shared:]) for p in asks}) > 1
    others = [p[:head + 16] for p in w.prompts]
    assert len(set(map(tuple, others))) == 4  # the documents differ from their first tokens
    # Seeded: the same requests on every call, other ones with another seed.
    assert rag_workload(tokenizer, 12, 4, (200, 300), 8, seed=3).prompts == w.prompts
    assert rag_workload(tokenizer, 12, 4, (200, 300), 8, seed=4).prompts != w.prompts


def test_bench_rag_runs_cold_then_warm_processes_with_identical_outputs(llama_path, tmp_path, capsys):
    rc = main(["bench", "throughput", "--workload", "rag", "--model", str(llama_path), "--dtype", "float32",
               "--rag-docs", "2", "--rag-requests", "4", "--rag-doc-len", "48", "80", "--rag-answer-len", "4",
               "--repeats", "1", "--model-preset", "tiny-llama", "--num-prompts", "4", "--prompt-len", "8", "24",
               "--output-len", "4", "8", "--kv-cache-memory", "64MiB", "--output-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "outputs identical cold vs warm: yes (4 of 4)" in out and "lower (target >= 5x)" in out
    data = json.loads((tmp_path / f"throughput-rag-{llama_path.name}.json").read_text())
    summary, (run,) = data["summary"], data["runs"]
    assert summary["outputs_identical"] and summary["ttft_ratio"] > 0 and summary["tier_bytes"] > 0
    # The warm process read the documents' blocks from the tier the cold one filled; the W1 run on an
    # empty tier never hit it.
    assert run["cold"]["disk_hit_blocks"] == 0 and run["warm"]["disk_hit_blocks"] > 0
    assert run["w1_empty_tier"]["disk_hit_blocks"] == 0 and run["w1_no_tier"]["disk_hit_blocks"] is None
