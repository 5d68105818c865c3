"""One run of the rag benchmark in a process of its own (``python -m pagellm.bench.rag_phase SPEC``): the
KV tier on disk is measured across restarts, so each run starts from nothing but the tier's folder.

SPEC is a JSON file: ``kind`` ("rag": requests one at a time, TTFT; "w1": the throughput workload
batched), ``model``, ``dtype``, ``engine_kwargs``, ``workload`` (prompts, output lengths), ``threads``
and ``out``, where the results go as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from pagellm.bench import backends as be
from pagellm.bench.workloads import Workload


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Run what ``spec`` describes here and return its results."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    w = spec["workload"]
    workload = Workload(w["name"], w["prompts"], w["output_lens"])
    model, dtype, kwargs = Path(spec["model"]), spec["dtype"], spec["engine_kwargs"]
    if spec["kind"] == "rag":
        return be.run_pagellm_one_by_one(model, workload, dtype, kwargs, label=spec.get("label", "pagellm"))
    res, llm = be.run_pagellm(model, workload, dtype, kwargs, label=spec.get("label", "pagellm"))
    disk = llm.llm_engine.kv_cache_manager.disk
    llm.shutdown()
    return {"elapsed_s": res.elapsed_s, "output_tokens_per_s": res.output_tokens_per_s,
            "ttft_mean_s": res.detail["ttft_mean_s"], "disk_hit_blocks": None if disk is None else disk.hit_blocks}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run_phase(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
