"""LoRA adapters with the model split over two processes: each rank keeps its share of every adapter
(column-parallel B rows, row-parallel A columns), and greedy tokens equal transformers' with PEFT's
merge_and_unload in float32, adapters and the base model in one batch, under chunked prefill, swap
preemption and the prefix cache; constrained requests with an adapter follow their grammar."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pagellm import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from tests.helpers import assert_all_blocks_free, random_prompts
from tests.lora.adapters import ATTN, MLP, assert_choice_answers_are_merged_models, build_adapter, merged_greedy
from tests.structured.schemas import SCHEMAS

MAX_TOKENS = 8
# name -> (target modules, rank, alpha)
ADAPTERS = {"attn": (ATTN, 8, 16), "all": (ATTN + MLP, 16, 32)}
# A small pool and step budget: the batch is chunked and swapped out on the way.
TIGHT = dict(dtype="float32", max_model_len=160, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
             max_num_seqs=16, swap_space=0.05, enable_prefix_caching=True)


# Grouped KV heads split 2 over 2 (q, k and v shards of their own); `make test-slow` also one KV head
# replicated over both ranks (each keeps all of k's and v's B rows), with q/k/v biases.
@pytest.fixture(scope="module", params=["llama-gqa-rope", pytest.param("qwen2", marks=pytest.mark.slow)])
def base(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Path:
    return checkpoints[request.param]


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("tp-adapters")
    return {name: LoRARequest(name, i + 1, str(build_adapter(base, root / name, targets, r=r, alpha=alpha,
                                                              seed=i + 1)))
            for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts(base: Path) -> list[list[int]]:
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    return random_prompts([5, 23, 40], vocab, seed=7)


@pytest.fixture(scope="module")
def llm(base: Path):
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, tensor_parallel_size=2, **TIGHT)
    yield llm
    llm.llm_engine.shutdown()


def greedy(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_two_ranks_match_peft_merged_with_adapters_and_base_in_one_batch(llm, base, adapters, prompts):
    expected = {None: merged_greedy(base, None, prompts, MAX_TOKENS)}
    for name, lora in adapters.items():
        expected[name] = merged_greedy(base, Path(lora.lora_path), prompts, MAX_TOKENS)
        assert expected[name] != expected[None], f"adapter {name} should change the greedy tokens"
    order: list[str | None] = [None, *adapters]
    stats = llm.llm_engine.scheduler.stats
    before = (stats.num_partial_prefills, stats.num_swap_outs)
    got = greedy(llm, prompts * len(order), [adapters[n] if n else None for n in order for _ in prompts])
    for i, name in enumerate(order):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == expected[name], name
    assert stats.num_partial_prefills > before[0] and stats.num_swap_outs > before[1]
    # Again from the prefix cache, which keys blocks by adapter: each reads its own K/V only.
    hits = llm.llm_engine.kv_cache_manager.prefix_cache_hits
    again = greedy(llm, [prompts[2]] * 3, [adapters["all"], None, adapters["attn"]])
    assert again == [expected["all"][2], expected[None][2], expected["attn"][2]]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > hits
    assert_all_blocks_free(llm)


def test_constrained_requests_with_an_adapter_follow_their_schema_next_to_the_base_model(llm, adapters):
    schema = SCHEMAS["flat"]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
    outs = llm.generate(["Answer in JSON:"] * 3, params, lora_request=[adapters["all"], None, adapters["attn"]],
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert len(set(texts)) > 1, texts  # (the adapters change what the grammar lets each pick)


def test_under_a_choice_grammar_an_adapter_answers_as_the_merged_model(llm, base, adapters, prompts):
    loras = [None, adapters["attn"], adapters["all"]]
    assert_choice_answers_are_merged_models(llm, base, loras, prompts[:2])
