"""LoRA adapters on the real server with the real openai client: chosen by the request's model, listed by
/v1/models with their parent, loaded and unloaded at run time behind the API key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.server_utils import RemoteServer
from tests.helpers import random_prompts
from tests.lora.adapters import ATTN, MLP, build_adapter, merged_greedy, peft_to_gguf

KEY = "sk-lora"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
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
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        srv = RemoteServer(base, ["--served-model-name", "base", "--dtype", "float32", "--enable-lora",
                                  "--max-loras", "2", "--lora-modules", f"attn={adapters['attn']}"], api_key=KEY)
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
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
