"""lm-evaluation-harness scores a small multiple-choice task through the real server (`local-completions`):
the log-likelihoods equal those of its own `hf` backend on the same float32 checkpoint."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.peers.conftest import API_KEY, MODEL

pytestmark = pytest.mark.peers

TASK = "pagellm_tiny_mc"
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Rome"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " small engine"], "answer": 0},
    {"question": "Paged attention stores the cache in", "choices": [" fixed size blocks", " one array"], "answer": 0},
]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def scores(results: dict) -> list[list[tuple[float, bool]]]:
    """Per document, per choice: (log-likelihood of the choice given the question, is it the greedy one)."""
    return [[(float(ll), bool(greedy)) for ((ll, greedy),) in s["resps"]]
            for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"])]


def test_local_completions_loglikelihoods_equal_the_hf_backend(server, llama_path, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    # One document whose right answer is the model's own greedy continuation, so is_greedy is exercised.
    greedy = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}).json()
    docs = DOCS + [{"question": "Once upon a time", "choices": [greedy["choices"][0]["text"], " there was"],
                    "answer": 0}]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    tasks = TaskManager(include_path=str(tmp_path))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions' key

    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=[TASK], task_manager=tasks, log_samples=True,
        model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={llama_path},"
                   "tokenizer_backend=huggingface,max_retries=1")
    local = lm_eval.simple_evaluate(
        model="hf", tasks=[TASK], task_manager=tasks, log_samples=True,
        model_args=f"pretrained={llama_path},dtype=float32,device=cpu")

    got, want = scores(served), scores(local)
    assert [len(d) for d in got] == [len(d["choices"]) for d in docs]
    for doc_got, doc_want in zip(got, want):
        assert [ll for ll, _ in doc_got] == pytest.approx([ll for ll, _ in doc_want], abs=1e-4)
        assert [g for _, g in doc_got] == [g for _, g in doc_want]
    assert got[-1][0][1] is True  # the greedy continuation is recognised as greedy
    assert served["results"][TASK]["acc,none"] == local["results"][TASK]["acc,none"]
