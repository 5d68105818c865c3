"""guidellm (the vLLM project's load generator) benchmarks the real server with synthetic prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.peers.conftest import API_KEY, MODEL

pytestmark = pytest.mark.peers

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 16, 6


def test_sweep_synchronous_throughput_and_constant_rate_without_errors(server, llama_path, tmp_path):
    report = tmp_path / "report.json"
    # A sweep of 3: synchronous, throughput, then one constant rate between the two measured rates.
    # guidellm's defaults otherwise: streamed /v1/chat/completions, usage read from the server's stream.
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server.url, "model": MODEL, "api_key": API_KEY},
        "profile": {"kind": "sweep", "sweep_size": 3},
        "tokenizer": {"kind": "huggingface_auto", "model": str(llama_path)},  # for the synthetic prompts
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    # One worker process, started by a fork server: 10 spawned ones (the default) double the run time on 2 cores.
    env = dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="1", GUIDELLM__MP_CONTEXT_TYPE="forkserver")
    run = subprocess.run([sys.executable, "-m", "guidellm", "run", "-c", "scenario.json", "--disable-console"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["type_"] for b in benchmarks] == ["synchronous", "throughput", "constant"]
    for b in benchmarks:
        requests = b["requests"]
        errors = [r["info"]["error"] for r in requests["errored"]]
        assert errors == [] and requests["incomplete"] == [], (errors[:1], server.log()[-2000:])
        assert len(requests["successful"]) == REQUESTS
        for r in requests["successful"]:
            # The counts come from the server's usage; synthetic prompts are 32 tokens before the chat template.
            assert r["output_tokens"] == OUTPUT_TOKENS and r["prompt_tokens"] > PROMPT_TOKENS
            assert 0 < r["time_to_first_token_ms"] < r["request_latency"] * 1000  # streamed: a first token came
        assert b["metrics"]["output_tokens_per_second"]["successful"]["mean"] > 0
    assert benchmarks[2]["config"]["strategy"]["rate"] > 0
