"""`pagellm run-batch` through the real command on a tiny model: OpenAI's batch file format in, one result
per request out (as the server would answer, equal to the offline LLM), streamed as requests finish."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagellm import LLM, BeamSearchParams, SamplingParams

MODEL = "tiny"
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "Tell me about pages."}]


def command(model: Path, source: Path, target: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "run-batch", "-i", str(source), "-o", str(target),
            "--model", str(model), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), *extra]


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": {"model": MODEL, **body}}


REQUESTS = [
    line("plain", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
                                      "ignore_eos": True}),
    line("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
    line("plp", "/v1/completions", {"prompt": "Hello world", "max_tokens": 1, "prompt_logprobs": 2}),
    line("beam", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                                     "use_beam_search": True}),
    # As the server: a field no OpenAI or vLLM body defines is ignored, with a warning.
    line("unknown-field", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "frobnicate": 1}),
    # Each of these fails alone, with the server's error.
    line("embed", "/v1/embeddings", {"input": "x"}),
    line("bad-field", "/v1/completions", {"prompt": "Hi", "top_p": 5}),
    line("wrong-type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}),
    line("stream", "/v1/chat/completions", {"messages": CHAT, "stream": True}),
    line("get", "/v1/completions", {"prompt": "Hi"}, method="GET"),
    line("nowhere", "/v1/nothing", {"prompt": "Hi"}),
    line("wrong-model", "/v1/completions", {"prompt": "Hi", "model": "other"}),
]
ERRORS = {
    "embed": (400, "url", "/v1/embeddings is not supported by this server"),
    "bad-field": (400, "top_p", "top_p must be a number in (0, 1]"),
    "wrong-type": (400, "max_tokens", "max_tokens"),
    "stream": (400, "stream", "stream is not supported in a batch"),
    "get": (400, "method", "method must be 'POST'"),
    "nowhere": (400, "url", "url must be /v1/completions or /v1/chat/completions"),
    "wrong-model": (404, "model", "the model 'other' does not exist"),
}


@pytest.fixture(scope="module")
def results(llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    source, target = folder / "requests.jsonl", folder / "results.jsonl"
    body = [json.dumps(r) for r in REQUESTS]
    body[3:3] = ["", "this is not JSON", '["a list"]']  # an empty line is skipped; the others fail alone
    source.write_text("\n".join(body) + "\n")
    run = subprocess.run(command(llama_path, source, target), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(x) for x in target.read_text().splitlines()]
    return lines, run.stderr


@pytest.fixture(scope="module")
def offline(llama_path):
    with LLM(str(llama_path), max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def by_id(lines: list[dict]) -> dict[str, dict]:
    return {x["custom_id"]: x for x in lines if x["custom_id"] is not None}


def test_every_request_gets_one_result_and_a_progress_bar(results):
    lines, stderr = results
    assert len(lines) == len(REQUESTS) + 2  # the two lines that are not requests get a result each too
    assert sorted(by_id(lines)) == sorted(r["custom_id"] for r in REQUESTS)
    for x in lines:
        assert set(x) == {"id", "custom_id", "response", "error"} and x["id"].startswith("batch_req_")
        assert set(x["response"]) == {"status_code", "request_id", "body"}
    assert "Running batch" in stderr and f"{len(lines)}/{len(lines)}" in stderr
    assert f"{len(lines) - len(ERRORS) - 2} succeeded, {len(ERRORS) + 2} failed" in stderr
    assert "fields this server does not know, ignored: 'frobnicate'" in stderr


def test_successful_results_equal_the_offline_llm(results, offline):
    got = by_id(results[0])
    for name in ("plain", "chat", "plp", "beam", "unknown-field"):
        assert got[name]["error"] is None and got[name]["response"]["status_code"] == 200
        assert got[name]["response"]["request_id"] == got[name]["response"]["body"]["id"]
    plain = got["plain"]["response"]["body"]
    assert plain["object"] == "text_completion" and plain["model"] == MODEL
    (want,) = offline.generate("The capital of France is",
                               SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert plain["choices"][0]["text"] == want.outputs[0].text
    chat = got["chat"]["response"]["body"]
    (want,) = offline.chat(CHAT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == want.outputs[0].text
    plp = got["plp"]["response"]["body"]["choices"][0]["prompt_logprobs"]
    (want,) = offline.generate("Hello world", SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert plp[0] is None and len(plp) == len(want.prompt_token_ids)
    for entry, expected in zip(plp[1:], want.prompt_logprobs[1:]):
        assert {int(t): v["rank"] for t, v in entry.items()} == {t: lp.rank for t, lp in expected.items()}
        assert [v["logprob"] for v in entry.values()] == pytest.approx([lp.logprob for lp in expected.values()],
                                                                       abs=1e-4)
    beams = got["beam"]["response"]["body"]["choices"]
    (want,) = offline.beam_search(["Once upon a time"], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [c["text"] for c in beams] == [s.text for s in want.sequences]


def test_a_bad_line_fails_alone_with_the_servers_error(results):
    lines, _ = results
    got = by_id(lines)
    for name, (status, param, message) in ERRORS.items():
        x = got[name]
        assert x["response"]["status_code"] == status, x
        assert x["response"]["body"] == {"error": x["error"]}
        assert message in x["error"]["message"] and x["error"]["param"] == param
    unnamed = [x for x in lines if x["custom_id"] is None]
    assert sorted(x["error"]["message"].split(" (")[0] for x in unnamed) == [
        "the line is not valid JSON", "the line must be a JSON object, got list"]
    assert all(x["response"]["status_code"] == 400 for x in unnamed)


def test_results_are_written_as_requests_finish(llama_path, tmp_path):
    """A quick request's result is in the output while a long one still runs."""
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    slow = line("slow", "/v1/completions", {"prompt": "A long story:", "max_tokens": 300, "n": 4,
                                            "use_beam_search": True, "ignore_eos": True})
    quick = line("quick", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    source.write_text(json.dumps(slow) + "\n" + json.dumps(quick) + "\n")
    proc = subprocess.Popen(command(llama_path, source, target), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        seen_while_running = None
        while proc.poll() is None:
            if target.exists() and target.read_text().endswith("\n"):
                seen_while_running = [json.loads(x)["custom_id"] for x in target.read_text().splitlines()]
                break
            time.sleep(0.02)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert seen_while_running == ["quick"]
    assert [json.loads(x)["custom_id"] for x in target.read_text().splitlines()] == ["quick", "slow"]


def test_a_missing_input_file_fails_before_the_model_loads(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "run-batch", "-i",
                          str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--input-file" in run.stderr and "is not a file" in run.stderr


def test_strict_requests_refuses_unknown_fields_as_serve_does(llama_path, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(line("x", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "frobnicate": 1})))
    run = subprocess.run(command(llama_path, source, target, "--strict-requests"), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    (result,) = [json.loads(x) for x in target.read_text().splitlines()]
    assert result["response"]["status_code"] == 400 and result["error"]["param"] == "frobnicate"
