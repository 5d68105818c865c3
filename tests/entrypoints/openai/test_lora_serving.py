"""LoRA adapters on the real server with the real openai client: chosen by the request's model, listed by
/v1/models with their parent, loaded and unloaded at run time behind the API key; the same with the model
split over two ranks, JSON schemas with adapters included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.server_utils import RemoteServer
from tests.helpers import random_prompts
from tests.lora.adapters import ATTN, MLP, build_adapter, merged_greedy, peft_to_gguf

KEY = "sk-lora"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def made(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The base checkpoint, the adapters, a prompt and each one's greedy text from PEFT's merged model."""
    base = checkpoints["llama-gqa-rope"]
    root = tmp_path_factory.mktemp("lora-serving")
    adapters = {"attn": build_adapter(base, root / "attn", ATTN, r=8, seed=1),
                "mlp": build_adapter(base, root / "mlp", MLP, r=4, seed=2)}
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompt = random_prompts([12], vocab, seed=5)[0]
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = {name: tok.decode(merged_greedy(base, path, [prompt], MAX_TOKENS)[0], skip_special_tokens=True)
             for name, path in [("base", None), *adapters.items()]}
    adapters["attn.gguf"] = peft_to_gguf(base, adapters["attn"], root / "attn.gguf")  # (llama.cpp's layout)
    return base, adapters, prompt, texts


def serve(base: Path, adapters: dict[str, Path], *extra: str) -> RemoteServer:
    """The server with --enable-lora, adapter attn registered, run-time loading allowed."""
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        return RemoteServer(base, ["--served-model-name", "base", "--dtype", "float32", "--enable-lora",
                                   "--max-loras", "2", "--lora-modules", f"attn={adapters['attn']}", *extra],
                            api_key=KEY)
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old


@pytest.fixture(scope="module")
def setup(made):
    base, adapters, prompt, texts = made
    srv = serve(base, adapters)
    yield srv, adapters, prompt, texts
    srv.stop()


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_adapters_by_model_name_listing_and_runtime_loading(setup):
    srv, adapters, prompt, texts = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "attn"}
    assert cards["attn"].model_extra["parent"] == "base" and cards["base"].model_extra["parent"] is None
    assert complete(client, "attn", prompt) == texts["attn"]
    assert complete(client, "base", prompt) == texts["base"]
    with pytest.raises(openai.NotFoundError, match="'mlp' does not exist"):
        complete(client, "mlp", prompt)
    with pytest.raises(openai.BadRequestError, match="use_beam_search with the LoRA adapter 'attn'"):
        client.completions.create(model="attn", prompt=prompt, max_tokens=2, extra_body={"use_beam_search": True})

    # Run-time loading: the API key guards it; then the adapter serves, and lists, until unloaded.
    body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
    assert httpx.post(srv.url + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=srv.headers)
    assert r.status_code == 200, r.text
    assert httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=srv.headers).status_code == 400
    bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"},
                     headers=srv.headers)
    assert bad.status_code == 400 and "no such folder" in bad.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {"base", "attn", "mlp"}
    assert complete(client, "mlp", prompt) == texts["mlp"]
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=srv.headers)
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"base", "attn"}
    with pytest.raises(openai.NotFoundError):
        complete(client, "mlp", prompt)

    # A llama.cpp LoRA GGUF file of the same adapter serves the same text.
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "attn-gguf",
                                                           "lora_path": str(adapters["attn.gguf"])},
                   headers=srv.headers)
    assert r.status_code == 200, r.text
    assert complete(client, "attn-gguf", prompt) == texts["attn"]


def test_adapters_and_base_stream_side_by_side(setup):
    srv, _, prompt, texts = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
    import concurrent.futures

    names = ["attn", "base"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: complete(client, n, prompt), names))
    assert got == [texts[n] for n in names]
    text = srv.metric("vllm:lora_requests_info")
    assert text > 0  # (set to the time of the last step, as vLLM's)


def test_two_ranks_serve_adapters_loaded_at_start_and_at_run_time(made):
    base, adapters, prompt, texts = made
    srv = serve(base, adapters, "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
        import concurrent.futures

        names = ["attn", "base", "attn"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            assert list(pool.map(lambda n: complete(client, n, prompt), names)) == [texts[n] for n in names]
        # Loaded at run time on rank 0: the other rank loads its share when a request first names it.
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])},
                       headers=srv.headers)
        assert r.status_code == 200, r.text
        assert complete(client, "mlp", prompt) == texts["mlp"]
        # llama.cpp's file of the same adapter: its q/k rows put back in order, then cut per rank.
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "attn-gguf",
                                                               "lora_path": str(adapters["attn.gguf"])},
                       headers=srv.headers)
        assert r.status_code == 200, r.text
        assert complete(client, "attn-gguf", prompt) == texts["attn"]

        # A JSON schema with an adapter, next to the base model's: both answers validate.
        schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["colour", "count"]}

        def ask(model: str) -> str:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Pick one."}], max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            return r.choices[0].message.content or ""

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, ["mlp", "base", "attn"]))
        for text in answers:
            jsonschema.validate(json.loads(text), schema)
    finally:
        assert srv.stop() == 0
