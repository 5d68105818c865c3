"""vLLM's ``prompt_logprobs`` and ``use_beam_search`` through the `openai` client against the real server,
equal to what the offline ``LLM`` gives on the same tiny model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from pagellm import LLM, BeamSearchParams, SamplingParams
from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "Say something about paging."}]


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def offline(llama_path):
    with LLM(str(llama_path), max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def as_json(entries: list[dict[int, Any] | None]) -> list[dict[str, dict[str, Any]] | None]:
    """The offline prompt logprobs as the server sends them."""
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def assert_same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        for token in w:
            assert g[token]["rank"] == w[token]["rank"]
            assert g[token]["decoded_token"] == w[token]["decoded_token"]
            assert g[token]["logprob"] == pytest.approx(w[token]["logprob"], abs=1e-4)


# ------------------------------------------------------------ prompt_logprobs
def test_completion_prompt_logprobs_equal_offline(client, offline):
    prompts = ["The capital of France is", "Paged attention saves memory"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True}).to_dict()
    want = offline.generate(prompts, SamplingParams(prompt_logprobs=2, max_tokens=4, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        out = want[c["index"] // 2]
        assert_same_prompt_logprobs(c["prompt_logprobs"], as_json(out.prompt_logprobs))
        assert len(c["prompt_logprobs"]) == len(out.prompt_token_ids)
        # Each position holds the prompt's own token and the 2 most likely, with their ranks.
        for pos, entry in enumerate(c["prompt_logprobs"][1:], start=1):
            assert str(out.prompt_token_ids[pos]) in entry and {1, 2} <= {v["rank"] for v in entry.values()}
        assert c["text"] == out.outputs[0].text


def test_chat_prompt_logprobs_at_the_top_level_equal_offline(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 1}).to_dict()
    (want,) = offline.chat(CHAT, SamplingParams(prompt_logprobs=1, max_tokens=3, temperature=0), use_tqdm=False)
    assert_same_prompt_logprobs(r["prompt_logprobs"], as_json(want.prompt_logprobs))
    assert "prompt_logprobs" not in r["choices"][0]
    assert r["usage"]["prompt_tokens"] == len(r["prompt_logprobs"])


def test_prompt_logprobs_zero_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 0}).to_dict()
    (c,) = r["choices"]
    plp = c["prompt_logprobs"]
    assert plp[0] is None and all(len(e) in (1, 2) for e in plp[1:])  # the prompt's token (and the top one)
    assert c["logprobs"]["token_logprobs"][1:] == [next(v["logprob"] for v in e.values() if v["decoded_token"] == t)
                                                   for e, t in zip(plp[1:], c["logprobs"]["tokens"][1:])]
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).to_dict()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(("route", "body", "message"), [
    ("completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 1}, "not available with stream=true"),
    ("chat", {"messages": CHAT, "stream": True, "prompt_logprobs": 2}, "not available with stream=true"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": 21}, "more than this server allows (--max-logprobs 20)"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": -1}, "more than this server allows (--max-logprobs 20)"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": -2}, "prompt_logprobs must be an integer >= 0"),
])
def test_prompt_logprobs_refusals(client, route, body, message):
    create = client.completions.create if route == "completions" else client.chat.completions.create
    known = {k: body.pop(k) for k in ("prompt", "messages", "stream") if k in body}
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, max_tokens=2, extra_body=body, **known)
    assert message in e.value.message and e.value.body["param"] == "prompt_logprobs"


def test_streaming_with_prompt_logprobs_zero_is_accepted(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 0, "ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------- beam search
def test_completion_beam_search_equals_offline(client, offline):
    prompts = ["The capital of France is", "Once upon a time"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, best_of=3,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5}).to_dict()
    want = offline.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        seq = want[c["index"] // 2].sequences[c["index"] % 2]
        assert c["text"] == seq.text
        assert c["finish_reason"] == ("stop" if seq.finished else "length")
    completion = sum(len(out.sequences[i].output_token_ids) for out in want for i in range(2))
    assert r["usage"]["completion_tokens"] == completion


def test_completion_beam_search_width_n_and_echo(client, offline):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, n=2, echo=True,
                                  extra_body={"use_beam_search": True, "ignore_eos": True}).to_dict()
    (want,) = offline.beam_search(["Hello world"], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert [c["text"] for c in r["choices"]] == ["Hello world" + s.text for s in want.sequences]
    assert all(c["finish_reason"] == "length" for c in r["choices"])


def test_chat_beam_search_equals_offline(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                       extra_body={"use_beam_search": True}).to_dict()
    ids = offline.llm_engine.apply_chat_template(CHAT, None, True, None)
    (want,) = offline.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [c["message"]["content"] for c in r["choices"]] == [s.text for s in want.sequences]
    assert [c["message"]["role"] for c in r["choices"]] == ["assistant", "assistant"]


def test_beam_search_does_not_hold_up_other_requests(server):
    """While a long beam search runs, other clients' requests are served (the loop is not blocked)."""
    async def run() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        beam = asyncio.create_task(aclient.completions.create(
            model=MODEL, prompt="A long story:", max_tokens=96, n=4,
            extra_body={"use_beam_search": True, "ignore_eos": True}))
        others = [await aclient.completions.create(model=MODEL, prompt=f"Quick {i}", max_tokens=2)
                  for i in range(3)]
        assert all(o.choices[0].text is not None for o in others)
        assert not beam.done()  # the short ones were answered while the search went on
        result = await beam
        assert len(result.choices) == 4 and result.usage.completion_tokens == 4 * 96
        await aclient.close()

    asyncio.run(run())


def test_a_client_that_leaves_aborts_its_beam_search(server):
    """The search (about 4 s here) stops once its client is gone: no more tokens are generated."""
    body = {"model": MODEL, "prompt": "A very long story:", "max_tokens": 480, "n": 4, "use_beam_search": True,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    time.sleep(0.5)  # the server notices within a tenth of a second and aborts the step in flight
    generated = server.metric("pagellm_generation_tokens_total")
    time.sleep(1.0)
    assert server.metric("pagellm_generation_tokens_total") == generated
    assert server.metric("pagellm_num_requests_running") == 0 and server.metric("pagellm_kv_cache_usage_perc") == 0


@pytest.mark.parametrize(("route", "body", "message", "param"), [
    ("completions", {"stream": True}, "use_beam_search cannot be streamed", "stream"),
    ("chat", {"stream": True}, "use_beam_search cannot be streamed", "stream"),
    ("completions", {"stop": ["x"]}, "'stop' cannot be used with use_beam_search", "stop"),
    ("completions", {"logprobs": 1}, "'logprobs' cannot be used with use_beam_search", "logprobs"),
    ("completions", {"best_of": 11}, "best_of is the beam width with use_beam_search: it must be in [1, 10]",
     "best_of"),
    ("chat", {"response_format": {"type": "json_object"}}, "'response_format' cannot be used with use_beam_search",
     "response_format"),
])
def test_beam_search_refusals(client, route, body, message, param):
    body = {"use_beam_search": True, **body}
    stream = body.pop("stream", False)
    if route == "completions":
        call = lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=stream,  # noqa: E731
                                                 extra_body=body)
    else:
        call = lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,  # noqa: E731
                                                      stream=stream, extra_body=body)
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert message in e.value.message and e.value.body["param"] == param
