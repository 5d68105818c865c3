"""LoRA adapters match transformers with PEFT's merge_and_unload of the same adapter, greedy in float32:
each target-module set alone, mixed with other adapters and the base model in one batch, over a prefix
cache, chunked prefill and preemption, and under a choice grammar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm import LLM, LoRARequest, SamplingParams
from tests.helpers import assert_all_blocks_free, random_prompts
from tests.lora.adapters import ATTN, MLP, assert_choice_answers_are_merged_models, build_adapter, merged_greedy

MAX_TOKENS = 8
# name -> (target modules, rank, alpha, rsLoRA)
ADAPTERS = {
    "attn": (ATTN, 8, 16, False),
    "mlp": (MLP, 4, 8, True),
    "all": (ATTN + MLP, 16, 32, False),
}


@pytest.fixture(scope="module")
def base(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama-gqa-rope"]  # (grouped KV heads: q, k and v of different widths)


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(base, root / name, targets, r=r, alpha=alpha, seed=i + 1, use_rslora=rs)
            for i, (name, (targets, r, alpha, rs)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts(base: Path) -> list[list[int]]:
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    return random_prompts([5, 23, 40], vocab, seed=7)


@pytest.fixture(scope="module")
def expected(base: Path, adapters: dict[str, Path], prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    out: dict[str | None, list[list[int]]] = {None: merged_greedy(base, None, prompts, MAX_TOKENS)}
    for name, path in adapters.items():
        out[name] = merged_greedy(base, path, prompts, MAX_TOKENS)
        assert out[name] != out[None], f"adapter {name} should change the greedy tokens"
    return out


def requests_of(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_target_set_matches_peft_merged(base, adapters, prompts, expected, name):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=16)
    lora = requests_of(adapters)[name]
    assert run(llm, prompts, [lora] * len(prompts)) == expected[name]
    assert_all_blocks_free(llm)


def test_adapters_and_base_mixed_in_one_batch(base, adapters, prompts, expected):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=16, max_loras=3)
    sizes = []
    manager = llm.llm_engine.model_runner.lora
    begin = manager.begin_step
    manager.begin_step = lambda ids, *a: sizes.append(len(set(ids) - {0})) or begin(ids, *a)
    reqs = requests_of(adapters)
    order: list[str | None] = [None, *reqs]
    got = run(llm, prompts * len(order), [reqs[n] if n else None for n in order for _ in prompts])
    for i, n in enumerate(order):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == expected[n], n
    assert max(sizes) == 3  # every adapter in one step, beside the base rows
    # The prefix cache is keyed by adapter: the same prompts again, each adapter after the others' blocks.
    got = run(llm, prompts * len(order), [reqs[n] if n else None for n in reversed(order) for _ in prompts])
    for i, n in enumerate(reversed(order)):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == expected[n], n
    assert_all_blocks_free(llm)


def test_max_loras_holds_others_back_and_preemption_and_chunks_keep_tokens(base, adapters, prompts, expected):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=16, max_loras=1, max_cpu_loras=2,
              block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, prefill_chunk_size=8, max_num_seqs=8)
    sizes = []
    manager = llm.llm_engine.model_runner.lora
    begin = manager.begin_step
    manager.begin_step = lambda ids, *a: sizes.append(len(set(ids) - {0})) or begin(ids, *a)
    reqs = requests_of(adapters)
    order: list[str | None] = [*reqs, None]
    got = run(llm, prompts * len(order), [reqs[n] if n else None for n in order for _ in prompts])
    for i, n in enumerate(order):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == expected[n], n
    assert max(sizes) == 1
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_bad_adapters_are_refused_with_what_to_do(base, adapters, tmp_path):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"rank r=16 is more than --max-lora-rank 8"):
        llm.generate("hi", sp, lora_request=LoRARequest("all", 1, str(adapters["all"])))
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        llm.generate("hi", sp, lora_request=LoRARequest("empty", 2, str(tmp_path)))
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (odd / f).write_bytes((adapters["attn"] / f).read_bytes())
    cfg = json.loads((odd / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (odd / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="target module.* lm_head are not supported"):
        llm.generate("hi", sp, lora_request=LoRARequest("odd", 3, str(odd)))
    with pytest.raises(ValueError, match="no such file; give a llama.cpp LoRA GGUF file"):
        llm.generate("hi", sp, lora_request=LoRARequest("gguf", 4, str(tmp_path / "a.gguf")))
    assert_all_blocks_free(llm)
    plain = LLM(str(base), dtype="float32")
    with pytest.raises(ValueError, match=r"without LoRA: pass enable_lora=True \(--enable-lora\)"):
        plain.generate("hi", sp, lora_request=LoRARequest("attn", 1, str(adapters["attn"])))


def test_dashboard_rows_name_each_requests_adapter(base, adapters):
    from pagellm.engine.kv_state import kv_state

    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=16)
    engine = llm.llm_engine
    reqs = requests_of(adapters)
    engine.add_request("a", "hello", SamplingParams(max_tokens=2), lora_request=reqs["attn"])
    engine.add_request("b", "hello", SamplingParams(max_tokens=2))
    engine.add_request("c", "hello", SamplingParams(max_tokens=2), lora_request=reqs["mlp"])
    engine.step()  # (max_loras 1: "c" waits for "a"'s adapter to leave)
    rows = {r["request_id"]: r for r in kv_state(engine.kv_cache_manager, engine.scheduler)["requests"]}
    assert {k: (r["lora_adapter"], r["queue"]) for k, r in rows.items()} == {
        "a": ("attn", "running"), "b": (None, "running"), "c": ("mlp", "waiting")}
    while engine.has_unfinished_requests():
        engine.step()


def test_under_a_choice_grammar_each_adapter_answers_as_its_merged_model(base, adapters, prompts):
    llm = LLM(str(base), enable_lora=True, dtype="float32", max_lora_rank=16, max_loras=3)
    reqs = requests_of(adapters)
    loras: list[LoRARequest | None] = [None, *reqs.values()]
    assert_choice_answers_are_merged_models(llm, base, loras, prompts[:2])
