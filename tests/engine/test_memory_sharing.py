"""Sharing on the real engine: prefix caching, n > 1 forks, beam search, pinned prefixes, memory report."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, BeamSearchParams, EngineArgs, LLMEngine, SamplingParams
from pagellm.core.sequence import child_seed
from pagellm.kernels import native
from tests.helpers import assert_all_blocks_free, hf_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(n: int, prefix_len: int, tail_len: int, seed: int = 0) -> list[list[int]]:
    (prefix,) = random_prompts([prefix_len], vocab=500, seed=seed)
    tails = random_prompts([tail_len] * n, vocab=500, seed=seed + 1)
    return [prefix + t for t in tails]


@pytest.mark.slow
def test_outputs_identical_with_prefix_caching_on_and_off_even_after_eviction(llama_path):
    prompts = shared_prefix_prompts(6, 40, 9) + shared_prefix_prompts(6, 33, 5, seed=5)
    kw = dict(max_model_len=96, block_size=4, num_kv_blocks=40, max_num_seqs=2)
    off = LLM(str(llama_path), enable_prefix_caching=False, **kw)
    on = LLM(str(llama_path), enable_prefix_caching=True, **kw)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    # Twice: the second pass runs after the small pool has evicted and refilled the cache.
    for _ in range(2):
        got = on.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    stats = on.kv_cache_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.prefix_cache_queries == 2 * sum(len(p) for p in prompts)
    assert any(o.num_cached_tokens > 0 for o in got)
    assert_all_blocks_free(on)
    assert off.kv_cache_stats().prefix_cache_hits == 0


@pytest.mark.slow
def test_customer_service_workload_peak_blocks_with_sharing_at_most_42_percent(llama_path):
    # Small version of the benchmark: 16 requests share a 1,000-token system prompt, each with its
    # own ~50-token message and 64 new tokens (the full one is benchmarks/prefix_sharing.py).
    prompts = shared_prefix_prompts(16, 1000, 50, seed=11)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    peaks = {}
    for caching in (False, True):
        llm = LLM(str(llama_path), max_model_len=1200, num_kv_blocks=1200, block_size=16,
                  enable_prefix_caching=caching, max_num_batched_tokens=2048)
        llm.generate(prompts, params, use_tqdm=False)
        peaks[caching] = llm.kv_cache_stats().peak_in_use_blocks
        assert_all_blocks_free(llm)
    assert peaks[False] == 16 * 70  # ceil((1000 + 50 + 64) / 16) blocks each, all at once
    assert peaks[True] <= 0.42 * peaks[False], peaks


def test_n4_stores_the_prompt_once_and_children_match_single_seeded_runs(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=600, num_kv_blocks=120, block_size=16))
    (prompt,) = random_prompts([500], vocab=500, seed=2)  # 31 full blocks + 1 partial (4 tokens)
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    request = engine.add_request("r", prompt, params)
    outs = engine.step()
    while not outs:
        outs = engine.step()
    manager = engine.kv_cache_manager
    tables = [manager.groups[0].block_table(s) for s in request.seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 32
    assert all(manager.groups[0].pool.blocks[b].ref_cnt == 4 for b in tables[0])
    assert manager.num_blocks - manager.num_free_blocks == 32  # the prompt is stored once
    engine.step()  # each child writes token 501 into the shared partial block: copy-on-write
    tables = [manager.groups[0].block_table(s) for s in request.seqs]
    assert all(t[:31] == tables[0][:31] for t in tables)
    assert all(manager.groups[0].pool.blocks[b].ref_cnt == 4 for b in tables[0][:31])  # full blocks never copied
    assert len({t[31] for t in tables}) == 4  # 3 copies + the original
    assert manager.num_blocks - manager.num_free_blocks == 35
    manager.assert_consistent()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    children = [c.token_ids for c in final.outputs]
    assert len({tuple(c) for c in children}) == 4
    llm = LLM(str(llama_path), max_model_len=600, num_kv_blocks=120, block_size=16)
    for i, tokens in enumerate(children):
        single = params.clone(n=1, seed=child_seed(42, i))
        assert llm.generate([prompt], single, use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert engine.kv_cache_manager.num_free_blocks == 120


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(checkpoints, name, width):
    path = checkpoints[name]
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=128, block_size=4)
    prompts = random_prompts([5, 23], vocab=500, seed=width)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=12))
    hf = hf_model(path)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                              do_sample=False, max_new_tokens=12, length_penalty=1.0, pad_token_id=0)
        assert [s.output_token_ids for s in out.sequences] == [r[len(prompt):].tolist() for r in ref]
        assert len(out.sequences) == width
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    assert_all_blocks_free(llm)
    # Beams shared their parents' blocks through the prefix cache.
    assert llm.kv_cache_stats().prefix_cache_hits > 0


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width must be an integer in"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width must be an integer in"):
        BeamSearchParams(beam_width=True, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_beams_that_reach_max_model_len_finish_by_length(llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=4)
    (prompt,) = random_prompts([61], vocab=500, seed=4)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    # Three tokens fit (61 + 3 = max_model_len): both beams come back with them, like generate().
    assert [len(s.output_token_ids) for s in out.sequences] == [3, 3]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(greedy[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="the prompt is 64 tokens long but max_model_len is 64"):
        llm.beam_search([prompt + [5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert_all_blocks_free(llm)


def test_pinned_prefixes_survive_eviction_and_hit_afterwards(llama_path):
    (system,) = random_prompts([64], vocab=500, seed=21)
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=48, block_size=8, preload_prompts=None)
    pinned = llm.preload_prefixes([system])
    assert pinned == 8 and llm.kv_cache_stats().pinned_blocks == 8
    # A workload of unrelated prompts that cycles through every free block many times.
    others = random_prompts([100] * 12, vocab=500, seed=22)
    llm.generate(others, GREEDY, use_tqdm=False)
    (out,) = llm.generate([system + [7, 8, 9]], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 64
    llm.llm_engine.kv_cache_manager.assert_consistent()
    assert llm.unpin_prefixes() == 8
    assert_all_blocks_free(llm)


def test_preload_prompts_engine_arg_and_file(llama_path, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text('["You are a helpful assistant. Answer briefly and politely, please.", "Hello there"]')
    llm = LLM(str(llama_path), max_model_len=64, num_kv_blocks=32, block_size=4, preload_prompts=str(f))
    assert llm.kv_cache_stats().pinned_blocks > 0
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt here\n\nsecond prompt here\n")
    from pagellm.prompt_file import read_prompt_file

    assert read_prompt_file(str(lines)) == ["first prompt here", "second prompt here"]
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(str(llama_path), max_model_len=64, num_kv_blocks=32, enable_prefix_caching=False,
            preload_prompts=["x"])
    small = LLM(str(llama_path), max_model_len=64, num_kv_blocks=20, block_size=4)
    with pytest.raises(ValueError, match="pin 10 of 20 KV blocks, leaving 10: too few for one sequence"):
        small.preload_prefixes([list(range(5, 45))])
    assert_all_blocks_free(small)  # refused: nothing stays pinned


def test_cache_salt_keeps_tenants_apart(llama_path):
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=64, block_size=4)
    (p,) = random_prompts([30], vocab=500, seed=4)
    engine = llm.llm_engine
    for rid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        engine.add_request(rid, p, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
    stats = llm.kv_cache_stats()
    assert stats.prefix_cache_hits == 28  # only "c" hit (tenant-a's blocks): 7 blocks of 4


def test_kv_cache_stats_and_reset(llama_path):
    llm = LLM(str(llama_path), max_model_len=128, num_kv_blocks=64, block_size=16)
    engine = llm.llm_engine
    engine.add_request("x", list(range(5, 25)), SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=1))
    engine.step()
    st = llm.kv_cache_stats()  # 20 prompt tokens computed, shared by 3 sequences in 2 blocks
    assert (st.in_use_blocks, st.physical_slots_used, st.logical_tokens) == (2, 20, 60)
    assert st.saved_by_sharing_slots == 40 and st.internal_fragmentation == pytest.approx(12 / 32)
    assert llm.reset_prefix_cache() is False  # refused while a request holds blocks
    while engine.has_unfinished_requests():
        engine.step()
    st = llm.kv_cache_stats()
    assert st.cached_blocks >= 1 and st.free_blocks == 64 and st.in_use_blocks == 0
    assert llm.reset_prefix_cache() is True and llm.kv_cache_stats().cached_blocks == 0


@pytest.mark.skipif(not (native.cascade_supported(torch.empty(1, 1, 64, 16, dtype=torch.bfloat16))
                         and native.linear_supported()),
                    reason="the one-call native decoder with its cascade: the native bfloat16 linear kernel "
                           "(AVX512-BF16 without AMX, where oneDNN runs the linears) and the bfloat16 dot products")
def test_decodes_sharing_a_prefix_attend_it_once_with_the_same_results(checkpoints, monkeypatch):
    """A cached system prompt and forked samples (n = 2) put decodes that share their first blocks in
    one step: the model runner hands those runs to the attention kernel (cascade), which reads the
    shared blocks once for the run. Tokens and logprobs are those of each decode reading its own."""
    import pagellm.worker.model_runner as model_runner

    path = checkpoints["llama-hd64"]  # head_dim 64: the kernel's bfloat16 path
    prompts = shared_prefix_prompts(5, 70, 9) + shared_prefix_prompts(3, 40, 20, seed=3)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, num_kv_blocks=128, enable_prefix_caching=True)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=1)]
    real_runs, real_layers = model_runner.cascade_runs, native.decode_layers
    found, reached = [], []

    def recorded(tables):
        runs = real_runs(tables)
        found.extend(runs)
        return runs

    def layers(layer_weights, step, *args):  # what the native decode step hands the kernel
        reached.append(step.num_cascade)
        return real_layers(layer_weights, step, *args)

    results = {}
    for cascade in (True, False):
        monkeypatch.setattr(model_runner, "cascade_runs", recorded if cascade else (lambda tables: []))
        monkeypatch.setattr(native, "decode_layers", layers)
        llm.reset_prefix_cache()
        results[cascade] = [[(c.token_ids, c.logprobs) for c in out.outputs]
                            for p in params for out in llm.generate(prompts, p, use_tqdm=False)]
        monkeypatch.undo()
    # Runs of up to 5 decodes sharing the 4 full blocks of the 70-token prompt, or the 2 of the 40.
    assert found and max(end - begin for begin, end, _ in found) >= 5
    assert {shared for _, _, shared in found} >= {4, 2}
    assert max(reached) >= 1  # and the native decode steps passed them on
    assert results[True] == results[False]
    assert_all_blocks_free(llm)
