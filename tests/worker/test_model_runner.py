"""The model runner's flat batch: the last layer computes only the rows a step uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pagellm.worker.model_runner as model_runner
from pagellm import LLM, SamplingParams
from pagellm.core.sched_output import ForkedSeq, NewSeqData, ScheduledSeq, SchedulerOutput
from pagellm.kernels import native
from pagellm.model.attention import DecodeBatch
from pagellm.worker.cache_engine import CacheEngine
from tests.helpers import assert_all_blocks_free, random_prompts


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in o.outputs]) for o in outs]


# head_dim 64 in bfloat16: native prefill attention and native linears, each row computed alone;
# head_dim 16 (llama, llama-gqa-rope): PyTorch's attention, which runs a cut chunk masked instead of
# causal, and in float32 oneDNN's linears, whose sums depend on the number of rows.
@pytest.mark.parametrize("name,dtype,native_rows", [("llama-hd64", "bfloat16", True),
                                                    ("qwen2-hd64-gqa", "bfloat16", True),
                                                    ("llama", "bfloat16", False), ("llama-gqa-rope", "float32", False)])
def test_last_layer_on_the_used_rows_gives_the_same_outputs(checkpoints, name, dtype, native_rows, monkeypatch):
    """Prompts split into chunks next to decodes, some scoring their prompt, one forked (n = 2): the
    tokens are the same whether the last layer runs on every row or only on the sampled and scored
    ones, the logprobs and prompt logprobs the same bits where every kernel computes a row on its
    own (else the same to rounding), and the skipped rows really are skipped."""
    prompts = random_prompts([70, 5, 130, 33, 90], vocab=500, seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1, logprobs=0),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0),
    ]
    # A 64-token budget: prompts in chunks, chunks next to decodes.
    llm = LLM(str(checkpoints[name]), dtype=dtype, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64,
              max_num_seqs=64, enable_prefix_caching=False)
    computed, total = [], []
    chosen = model_runner.choose_output_rows

    def recording(meta, num_tokens, num_decodes, needed):
        kept = chosen(meta, num_tokens, num_decodes, needed)
        computed.append(num_tokens if kept is None else len(kept.rows))
        total.append(num_tokens)
        return kept

    monkeypatch.setattr(model_runner, "choose_output_rows", recording)
    pruned = _generate(llm, prompts, params)
    # Every prompt row but the last skips it, except in the prompts scored for prompt logprobs.
    unscored = [p for p, sp in zip(prompts, params) if sp.prompt_logprobs is None]
    assert sum(total) - sum(computed) == sum(len(p) - 1 for p in unscored)
    monkeypatch.setattr(model_runner, "choose_output_rows", lambda *args: None)
    every_row = _generate(llm, prompts, params)
    if native_rows and native.linear_supported() and native.load() is not None:
        assert pruned == every_row
        return
    tol = dict(rel=1e-4, abs=1e-3 if dtype == "bfloat16" else 1e-4)
    assert len(pruned) == len(every_row)
    for (prompt_lp_a, outs_a), (prompt_lp_b, outs_b) in zip(pruned, every_row):
        assert len(outs_a) == len(outs_b)
        for (tokens_a, lp_a, cum_a), (tokens_b, lp_b, cum_b) in zip(outs_a, outs_b):
            assert tokens_a == tokens_b
            assert (lp_a is None) == (lp_b is None) and (cum_a is None) == (cum_b is None)
            assert cum_a is None or cum_a == pytest.approx(cum_b, **tol)
            for a, b in zip(lp_a or [], lp_b or [], strict=True):
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, **tol) for t in a)
        assert (prompt_lp_a is None) == (prompt_lp_b is None)
        for a, b in zip(prompt_lp_a or [], prompt_lp_b or [], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, **tol) for t in a)


def test_prepare_builds_one_flat_batch_decodes_first():
    """Decodes first (longest context first), then each prefill chunk; slots from the block tables;
    the sampled rows (a fork samples its parent's row), the scored prompt rows, and the last layer's
    rows (every decode, each prefill from its first used row; a chunk that samples nothing: none)."""
    cache = CacheEngine(1, 16, 4, 2, 8, torch.float32, torch.device("cpu"))
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4), set_attention_backend=lambda b: None)
    runner = model_runner.ModelRunner(model, cache, sampler=None, device=torch.device("cpu"))
    tokens = list(range(100, 120))
    prompt, decode, forked, chunk, child = range(5)  # sequence ids
    tables = {prompt: [3, 4], decode: [7, 8], chunk: [9, 10], forked: [1, 2, 5]}
    scheduled = [
        ScheduledSeq(prompt, 0, 5, sample=True, prompt_logprobs_range=(1, 4)),
        ScheduledSeq(decode, 6, 1, sample=True),
        ScheduledSeq(chunk, 4, 3, sample=False),
        ScheduledSeq(forked, 9, 1, sample=True, fork_children=[ForkedSeq(child, seed=7)]),
    ]
    generating = (decode, forked)  # (their prompts are 6 tokens: positions 6 and 9 are generated tokens)
    runner.requests.apply(SchedulerOutput(scheduled, new_seqs=[
        NewSeqData(seq_id, tokens[:6], tokens[6:], SamplingParams(), None, [table]) if seq_id in generating
        else NewSeqData(seq_id, tokens, [], SamplingParams(), None, [table]) for seq_id, table in tables.items()]))
    batch = runner.prepare(scheduled)
    assert batch.positions.tolist() == [9, 6, 4, 5, 6, 0, 1, 2, 3, 4]
    assert batch.input_ids.tolist() == [tokens[p] for p in batch.positions.tolist()]
    assert batch.attn.slot_mapping.tolist() == [21, 34, 40, 41, 42, 12, 13, 14, 15, 16]
    assert batch.attn.slot_offsets.tolist() == [p % 4 for p in batch.attn.slot_mapping.tolist()]
    assert [(s.q_start, s.q_len, s.context_len, s.block_table.tolist()) for s in batch.attn.prefills] == [
        (2, 3, 7, [9, 10]), (5, 5, 5, [3, 4])]
    decodes = batch.attn.decode
    assert batch.attn.num_decodes == 2
    if isinstance(decodes, DecodeBatch):
        assert decodes.tables.tolist() == [[1, 2, 5], [7, 8, 0]] and decodes.lens.tolist() == [10, 7]
    else:  # two groups: 2 blocks are under GROUP_SHARE of 3
        assert [(g.start, g.num, g.tables.tolist()) for g in decodes.groups] == [(0, 1, [[1, 2, 5]]), (1, 1, [[7, 8]])]
    s = batch.sampling
    assert [q.seq_id for q in s.seqs] == [2, 4, 1, 0] and s.rows == [0, 0, 1, 9]
    assert s.lp_rows == [6, 7, 8] and s.lp_targets == tokens[2:5] and s.lp_owners == [(runner.requests[prompt], 3)]
    child_seq = s.seqs[1]  # the forked child
    assert (child_seq.prompt_token_ids, child_seq.seed, child_seq.block_tables) == (tokens[:6], 7, [[]])
    assert batch.attn.output_rows.rows == [0, 1, 6, 7, 8, 9]
    assert batch.logits_rows.tolist() == [0, 0, 1, 5, 2, 3, 4]
