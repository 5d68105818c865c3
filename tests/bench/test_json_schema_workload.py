"""`pagellm bench throughput --workload json-schema`: half the requests constrained, their decode rate
against the unconstrained ones' and a run with no constraint (well-formed results, no timing asserts)."""

from __future__ import annotations

import json

import pytest

from pagellm.bench.workloads import BENCH_SCHEMA, json_schema_workload
from pagellm.entrypoints.cli import main

TINY = ["--model-preset", "tiny-llama", "--dtype", "float32", "--num-prompts", "4", "--prompt-len", "8", "24",
        "--output-len", "8", "16", "--kv-cache-memory", "64MiB"]


def test_every_other_request_is_constrained():
    w = json_schema_workload(5, (4, 8), (4, 8), 512)
    assert w.name == "json-schema" and w.meta["constrained"] == [False, True, False, True, False]
    assert w.meta["schema"] == BENCH_SCHEMA


@pytest.mark.slow
def test_json_schema_workload_reports_the_cost(tmp_path, capfd):
    assert main(["bench", "throughput", *TINY, "--workload", "json-schema", "--backend", "pagellm",
                 "--output-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "json-schema: per-request decode tok/s" in out
    data = json.loads((tmp_path / "throughput-json-schema-tiny-llama-bpe.json").read_text())
    for key in ("constrained_decode_tok_s", "unconstrained_decode_tok_s", "baseline_decode_tok_s",
                "constrained_vs_unconstrained", "unconstrained_vs_baseline"):
        assert data[key] > 0
    assert len(data["results"]["pagellm"]["detail"]["decode_tok_s"]) == 4
