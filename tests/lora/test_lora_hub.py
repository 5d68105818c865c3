"""A LoRA adapter named by a hub id comes down through huggingface_hub (a local hub, HF_ENDPOINT), only
its PEFT files, and runs as its local folder does."""

from __future__ import annotations

import pytest

from pagellm import LLM, LoRARequest, SamplingParams
from tests.hub.local_hub import LocalHub
from tests.lora.adapters import ATTN, build_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def adapter_hub(llama_path, tmp_path, monkeypatch):
    folder = build_adapter(llama_path, tmp_path / "repo", ATTN, r=4, seed=3)
    (folder / "README.md").write_text("an adapter card")
    hub = LocalHub()
    hub.add("org/tiny-lora", folder)
    monkeypatch.setenv("HF_ENDPOINT", hub.start())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield folder
    hub.stop()


def test_an_adapter_hub_id_runs_as_its_folder(adapter_hub, llama_path, tmp_path):
    llm = LLM(str(llama_path), enable_lora=True, max_model_len=64, num_kv_blocks=32, dtype="float32")
    local = llm.generate(["Hello"], GREEDY, lora_request=LoRARequest("local", 1, str(adapter_hub)), use_tqdm=False)
    hub = llm.generate(["Hello"], GREEDY, lora_request=LoRARequest("hub", 2, "org/tiny-lora"), use_tqdm=False)
    base = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert hub[0].outputs[0].token_ids == local[0].outputs[0].token_ids != base[0].outputs[0].token_ids
    got = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and "snapshots" in str(p))
    assert got == ["adapter_config.json", "adapter_model.safetensors"]
