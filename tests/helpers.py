"""Helpers shared by the tests: the transformers oracle and the invariant checks."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from pagellm import LLM


@lru_cache(maxsize=8)
def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers model for a checkpoint, with EOS handling off (pagellm runs with ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_prompt_logprobs(path: Path, prompt_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(len - 1,) log-probability of each prompt token after the first."""
    model = hf_model(path, dtype)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1)


def assert_all_blocks_free(llm: LLM) -> None:
    """After every request ended: invariants hold, no block is in use, and the model runner holds no
    sequence once told the last finished ones (the next step tells it)."""
    manager = llm.llm_engine.kv_cache_manager
    manager.assert_consistent()
    assert manager.num_free_blocks == manager.num_blocks, (
        f"{manager.num_blocks - manager.num_free_blocks} blocks still in use after all requests ended"
    )
    assert not any(g.block_tables or g.cpu_tables for g in manager.groups)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.step() == []
    assert not len(llm.llm_engine.model_runner.requests)


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the special tokens (ids 0-3) so prompts look like text.
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
