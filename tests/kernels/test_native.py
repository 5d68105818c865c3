"""The native decode-attention kernel against dense attention, and the engine without it."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.model.attention import AttentionMetadata, write_kv
from pagellm.worker.cache_engine import kv_shapes
from tests.model.test_attention import _reference

needs_kernel = pytest.mark.skipif(native.load() is None, reason="no C compiler on this machine")


def _cache_with_history(lens, block_size, kv_heads, d, dtype, num_blocks=96, seed=0):
    """Pools holding each sequence's K/V at scattered blocks; returns pools, tables (padded), K, V."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.zeros(s, dtype=dtype) for s in kv_shapes(num_blocks, block_size, kv_heads, d))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        meta = AttentionMetadata(slot_mapping=slots, slot_blocks=slots // block_size, slot_offsets=slots % block_size)
        write_kv(k, v, k_cache, v_cache, meta)
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    # Padding points at a block that holds another sequence's data: the kernel must not read it.
    padded = torch.tensor([t + [tables[0][0]] * (width - len(t)) for t in tables], dtype=torch.long)
    return k_cache, v_cache, padded, keys, values


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5, 1])  # 16 has its own vector path
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 7])
# Several sequences (one work item each): one token, exactly one block, one past it, several
# blocks. A lone sequence is split by KV head across the threads.
@pytest.mark.parametrize("lens", [[1, 16, 17, 40, 3], [37]])
@pytest.mark.parametrize("threads", [1, 3])  # how the work splits depends on the thread count
def test_decode_matches_dense_attention(dtype, block_size, heads, kv_heads, window, lens, threads):
    d = 32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_decode(dtype, block_size, heads, kv_heads, window, lens, d)
    finally:
        torch.set_num_threads(before)


def _check_decode(dtype, block_size, heads, kv_heads, window, lens, d):
    k_cache, v_cache, tables, keys, values = _cache_with_history(lens, block_size, kv_heads, d, dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    scratch = native.scratch_for(heads, d, block_size, tables.shape[1])
    out = native.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), scratch, d**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(lens):
        want = _reference(q[i : i + 1].double(), keys[i].double(), values[i].double(), [n - 1], window, d**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[i].double(), want[0], atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
# MHA, groups of 3 (a partial chunk), 7 (Qwen2-0.5B: chunks of 4 + 3) and 8 (MQA).
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("lens", [[1, 16, 17, 40, 3], [37]])  # [37]: fewer sequences than threads, split by KV head
def test_bf16_vector_paths(head_dim, heads, kv_heads, window, threads, lens):
    """bfloat16 pools at block_size 16 and head_dim 64/128 take their own vector paths. The portable one
    sums in the float32 path's order, so its output is that path's, rounded once to bfloat16. The one
    with the CPU's bfloat16 dot products (where there are some) pairs its sums and weighs the values
    with bfloat16 probabilities: attention to bfloat16's precision."""
    k16, v16, tables, keys, values = _cache_with_history(lens, 16, kv_heads, head_dim, torch.bfloat16)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)  # strided, as the model passes it
    scratch = native.scratch_for(heads, head_dim, 16, tables.shape[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    had_dot = native.use_bf16_dot_products(False)
    try:
        portable = native.paged_decode_attention(q, k16, v16, tables, torch.tensor(lens), scratch, head_dim**-0.5,
                                                 window)
        native.use_bf16_dot_products(True)
        dot = native.paged_decode_attention(q, k16, v16, tables, torch.tensor(lens), scratch, head_dim**-0.5, window)
        want = native.paged_decode_attention(q.float(), k16.float(), v16.float(), tables, torch.tensor(lens),
                                             scratch, head_dim**-0.5, window)
    finally:
        torch.set_num_threads(before)
        if had_dot is not None:
            native.use_bf16_dot_products(had_dot)
    assert torch.equal(portable, want.to(torch.bfloat16))
    for i, n in enumerate(lens):  # and both are attention
        ref = _reference(q[i : i + 1].double(), keys[i].double(), values[i].double(), [n - 1], window,
                         head_dim**-0.5)
        torch.testing.assert_close(portable[i].double(), ref[0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dot[i].double(), ref[0], atol=2e-2, rtol=2e-2)
    if had_dot is None:  # no such instructions here: the portable path ran both times
        assert torch.equal(dot, portable)


# Where the kernel ignores a cascade (no bfloat16 dot products) these tests would compare a path with itself.
needs_cascade = pytest.mark.skipif(not native.cascade_supported(torch.empty(1, 1, 64, 16, dtype=torch.bfloat16)),
                                   reason="cascade attention needs the bfloat16 dot products (AVX512-BF16)")


def _padded(tables):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _shared_prefix_pools(lens, prefixes, kv_heads, head_dim, seed=0):
    """bfloat16 pools (block_size 16) and block tables: sequence i starts with blocks base..base+count-1
    for prefixes[i] = (base, count) < 32 (count 0: none), then blocks of its own."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 32 + sum(-(-n // 16) for n in lens)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(torch.bfloat16)
                        for shape in kv_shapes(num_blocks, 16, kv_heads, head_dim))
    own = iter(range(32, num_blocks))
    tables = [list(range(base, base + k)) + [next(own) for _ in range(-(-n // 16) - k)]
              for n, (base, k) in zip(lens, prefixes)]
    return k_cache, v_cache, tables


@needs_cascade
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cascade_gives_each_sequence_the_bits_it_gets_alone(head_dim, heads, kv_heads, threads):
    """Decodes sharing their first blocks read those blocks once for the run: the same output, to the
    bit, as each sequence reading them itself. Runs: 5 sequences (more than one pass of 4 rows) sharing
    the 2 blocks all of them hold (the fourth wholly inside them, the others sharing 10), 2 sharing 10,
    2 sharing 3 of 3 and 4, a loner, 18 sharing 2."""
    from pagellm.model.attention import cascade_runs

    lens = [170, 200, 161, 32, 175, 300, 500, 60, 70, 40] + [40 + 9 * i for i in range(18)]
    prefixes = [(0, 10), (0, 10), (0, 10), (0, 2), (0, 10), (10, 10), (10, 10), (20, 3), (20, 4), (0, 0)]
    prefixes += [(24, 2)] * 18  # more sequences than the kernel takes at a time (16)
    k16, v16, tables = _shared_prefix_pools(lens, prefixes, kv_heads, head_dim)
    runs = cascade_runs(tables)
    assert runs == [(0, 5, 2), (5, 7, 10), (7, 9, 3), (10, 28, 2)]
    padded = _padded(tables)
    width = padded.shape[1]
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)  # strided, as the model passes it
    scratch = native.scratch_for(heads, head_dim, 16, width)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, head_dim**-0.5)
        together = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, head_dim**-0.5,
                                                 cascade=torch.tensor(runs))
        windowed = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, head_dim**-0.5,
                                                 window=50, cascade=torch.tensor(runs))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    # A window skips the cascade (the shared blocks may lie before it): the plain windowed result.
    want = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, head_dim**-0.5, window=50)
    assert torch.equal(windowed, want)
    for i, n in enumerate(lens):  # and it is attention
        keys = k16[padded[i, : -(-n // 16)]].permute(0, 3, 1, 2).reshape(-1, kv_heads, head_dim)[:n]
        values = v16[padded[i, : -(-n // 16)]].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        ref = _reference(q[i : i + 1].double(), keys.double(), values.double(), [n - 1], None, head_dim**-0.5)
        torch.testing.assert_close(together[i].double(), ref[0], atol=2e-2, rtol=2e-2)


@needs_cascade
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("threads", [1, 4])  # 4: more threads than sequences, the work split by KV head
def test_cascade_of_two_sequences_and_a_loner(head_dim, threads):
    """The first sequence lies wholly inside the 2 shared blocks, its last one partly filled."""
    lens = [27, 75, 50]
    k16, v16, tables = _shared_prefix_pools(lens, [(0, 2), (0, 2), (2, 2)], 2, head_dim)
    padded = _padded(tables)
    q = torch.randn(3, 6, head_dim).to(torch.bfloat16)
    scratch = native.scratch_for(6, head_dim, 16, padded.shape[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, 0.125)
        together = native.paged_decode_attention(q, k16, v16, padded, torch.tensor(lens), scratch, 0.125,
                                                 cascade=torch.tensor([[0, 2, 2]]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)


@needs_kernel
@pytest.mark.parametrize("cascade,match", [
    ([0, 2, 2], "cascade must be a contiguous"),
    ([[0, 2, 4]], "1 <= shared <= their blocks"),  # the first sequence has 3 blocks
    ([[1, 3, 1]], "disjoint runs"),  # past the last sequence
    ([[0, 2, 0]], "disjoint runs"),
])
def test_cascade_is_refused_when_it_does_not_fit_the_batch(cascade, match):
    k16, v16, tables = _shared_prefix_pools([40, 75], [(0, 2), (0, 2)], 2, 64)
    padded = _padded(tables)
    q, scratch = torch.randn(2, 2, 64).to(torch.bfloat16), native.scratch_for(2, 64, 16, padded.shape[1])
    with pytest.raises(ValueError, match=match):
        native.paged_decode_attention(q, k16, v16, padded, torch.tensor([40, 75]), scratch, 0.125,
                                      cascade=torch.tensor(cascade))


@needs_kernel
def test_large_scores_do_not_overflow():
    """Scores far apart (one key dominates) give a one-hot softmax, not inf or NaN."""
    d, block_size = 16, 16
    k_cache, v_cache, tables, keys, values = _cache_with_history([20], block_size, 1, d, torch.float32)
    q = keys[0][7:8].clone() * 50  # (1, 1, d): scores up to ~50 * |k|^2
    scratch = native.scratch_for(1, d, block_size, tables.shape[1])
    out = native.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([20]), scratch, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], values[0][7, 0], atol=1e-4, rtol=1e-4)


def test_no_compiler_falls_back_to_pytorch(llama_path, monkeypatch, tmp_path, caplog):
    """Without a working compiler the engine warns once and gives the same greedy tokens."""
    prompts = ["the quick brown fox", "paged attention"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(llama_path), dtype="float32")
    assert (llm.llm_engine.model_runner.attn_backend.name == "native") == (native.load() is not None)
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))  # nothing built there yet
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pagellm.kernels.native"):
            llm = LLM(str(llama_path), dtype="float32")
        assert native.load() is None
        assert llm.llm_engine.model_runner.attn_backend.name != "native"
        assert "could not be built" in caplog.text
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
    assert without == with_kernel


def test_unwritable_cache_falls_back(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(blocker))  # kernels/ cannot be created under a file
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pagellm.kernels.native"):
            assert native.load() is None
        assert "could not be built" in caplog.text
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert not native.supports(torch.device("cpu"), torch.float32)
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


@needs_kernel
@pytest.mark.slow
def test_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        native.load.cache_clear()
        assert native.load() is not None  # loads the cached library, no rebuild
        assert built[0].stat().st_mtime_ns == mtime
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 1000, 32003])
def test_argmax_logsumexp_matches_torch(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g) * 5
    logits[1] = 0.25  # all tied: the first index wins, as with torch.argmax
    if vocab > 20:
        logits[2, 3] = logits[2, 17] = 100.0  # tied maximum in two different lanes
        logits[3, vocab // 2 :] = float("-inf")  # masked entries contribute nothing
    idx, lse = native.argmax_logsumexp(logits)
    assert idx.tolist() == logits.argmax(dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-5)
    alone, none = native.argmax_logsumexp(logits, with_lse=False)  # the argmax pass only
    assert none is None and torch.equal(alone, idx)


def test_argmax_logsumexp_declines_what_it_cannot_do():
    assert native.argmax_logsumexp(torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    assert native.argmax_logsumexp(torch.zeros(8)) is None


@needs_kernel
def test_argmax_logsumexp_non_finite_rows_as_torch():
    logits = torch.zeros(3, 40)
    logits[0, 5] = logits[0, 9] = float("nan")  # the first NaN is the argmax; logsumexp NaN
    logits[1, 30] = float("inf")
    logits[2] = float("-inf")
    idx, lse = native.argmax_logsumexp(logits)
    assert idx.tolist() == logits.argmax(dim=-1).tolist() == [5, 30, 0]
    assert torch.isnan(lse[0]) and lse[1] == float("inf") and lse[2] == float("-inf")
    assert native.argmax_logsumexp(logits, with_lse=False)[0].tolist() == [5, 30, 0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32)])
def test_rotary_in_place_equals_the_pytorch_path(dtype, heads, kv_heads, head_dim):
    from transformers import LlamaConfig

    from pagellm.model.layers import RotaryEmbedding

    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    rotary = RotaryEmbedding(cfg, head_dim, max_position=256)
    n, q_size, kv_size = 9, heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(n, q_size + 2 * kv_size).to(dtype)
    positions = torch.tensor([0, 1, 2, 50, 51, 100, 200, 254, 255])
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rotary(positions, q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim))
    got = qkv.clone()
    assert rotary.rotate_qk_(positions, got, heads, kv_heads)
    assert torch.equal(got[:, :q_size].view(n, heads, head_dim), want_q)  # the same bits
    assert torch.equal(got[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim), want_k)
    assert torch.equal(got[:, q_size + kv_size :], qkv[:, q_size + kv_size :])  # values untouched


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [8, 100, 512])
def test_rms_norm_matches_the_pytorch_path(dtype, hidden):
    from pagellm.model.layers import RMSNorm

    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data.normal_()
    norm = norm.to(dtype)
    x = (torch.randn(33, hidden) * 4).to(dtype)
    got, want = norm(x), norm.reference(x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # the same bfloat16 value, or its neighbour where the float32 sum rounds the other way
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    strided = x[:, :hidden // 2]  # not contiguous: the PyTorch path
    assert native.rms_norm(strided, norm.weight[: hidden // 2], 1e-6) is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_the_residual_adds_then_norms(dtype):
    from pagellm.model.layers import RMSNorm

    norm = RMSNorm(100, 1e-6)
    norm.weight.data.normal_()
    norm = norm.to(dtype)
    x, residual = (torch.randn(17, 100) * 3).to(dtype), (torch.randn(17, 100) * 3).to(dtype)
    total = x + residual  # what PyTorch's addition gives, rounding included
    got, new_residual = norm(x, residual.clone())
    assert torch.equal(new_residual, total)
    assert torch.equal(got, norm(total))  # the same kernel on the sum
    torch.testing.assert_close(got.float(), norm.reference(total).float(), atol=1e-5, rtol=2**-7)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 300), (64, 1408)])  # 300: a partial column chunk
def test_silu_and_mul_matches_pytorch(dtype, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zeros
    gate, up = gate_up.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = native.silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:  # the same bfloat16 value, or its neighbour where exp's last bit rounds the other way
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2**-7)
    assert native.silu_and_mul(gate_up[:, 1:]) is None  # odd width / not contiguous: the PyTorch path


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 64), (4, 1, 64), (14, 2, 64), (6, 2, 128)])
@pytest.mark.parametrize("cached,new,window", [(0, 37, None), (0, 16, None), (21, 30, None), (40, 9, None),
                                               (0, 50, 20), (33, 17, 8),
                                               # long enough for 64-token work items (on 2 threads)
                                               (0, 300, None), (45, 290, 100)])
def test_prefill_matches_dense_attention(dtype, heads, kv_heads, head_dim, cached, new, window):
    """A fresh prompt, or a chunk after cached context, attending over the pool through its block table;
    queries come strided out of a fused qkv buffer, as in the model."""
    block_size, total = 16, cached + new
    k_cache, v_cache, tables, keys, values = _cache_with_history([total], block_size, kv_heads, head_dim, dtype)
    qkv = torch.randn(new, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(new, heads, head_dim)  # rows strided by the qkv width
    assert native.prefill_supported(k_cache)
    want = _reference(q.double(), keys[0].double(), values[0].double(), list(range(cached, total)), window,
                      head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # bfloat16: with the CPU's bfloat16 dot products where it has them, and on the portable path.
    for dot in (True, False):
        had_dot = native.use_bf16_dot_products(dot)
        try:
            out = native.paged_prefill_attention(q, k_cache, v_cache, tables[0], cached, head_dim**-0.5, window)
            given = torch.full((new, heads, head_dim), float("nan"), dtype=dtype)
            into = native.paged_prefill_attention(q, k_cache, v_cache, tables[0], cached, head_dim**-0.5, window,
                                                  out=given)
        finally:
            if had_dot is not None:
                native.use_bf16_dot_products(had_dot)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        assert into is given and torch.equal(given, out)  # written in place: the same values


def test_prefill_kernel_shapes():
    pools = [torch.zeros(s) for s in kv_shapes(4, 8, 2, 64)]  # block_size 8: PyTorch's flash kernel
    assert not native.prefill_supported(pools[0])
    assert not native.prefill_supported(torch.zeros(kv_shapes(4, 16, 2, 32)[0]))  # head_dim 32


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (14, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("window", [None, 100])
def test_a_prefill_row_does_not_depend_on_the_other_rows(heads, kv_heads, head_dim, window):
    """A query's output is the same bits computed with its whole prompt or in a later chunk of it (other
    work items, tiles, item sizes; its keys over several softmax chunks): the last layer relies on it to
    run only the rows it keeps, and chunked prefill to match an unchunked one."""
    total = 600
    k_cache, v_cache, tables, _, _ = _cache_with_history([total], 16, kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(total, heads, head_dim).bfloat16()
    full = native.paged_prefill_attention(q, k_cache, v_cache, tables[0], 0, head_dim**-0.5, window)
    for split in (267, 560):  # 560: 40 queries, in 16-token items where the whole prompt has 64-token ones
        later = native.paged_prefill_attention(q[split:], k_cache, v_cache, tables[0], split, head_dim**-0.5,
                                               window)
        assert torch.equal(full[split:].view(torch.int16), later.view(torch.int16))  # bits, the sign of 0 too


@needs_kernel
def test_prefill_rejects_an_unfit_output_buffer():
    k_cache, v_cache, tables, _, _ = _cache_with_history([20], 16, 2, 64, torch.bfloat16)
    q = torch.randn(20, 2, 64).bfloat16()
    for bad in (torch.empty(20, 2, 64), torch.empty(19, 2, 64).bfloat16(),
                torch.empty(20, 64, 2).bfloat16().transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            native.paged_prefill_attention(q, k_cache, v_cache, tables[0], 0, 0.125, out=bad)


def test_sampler_native_and_pytorch_paths_agree(llama_path, monkeypatch):
    """Greedy and seeded random requests with top logprobs, sampled through the kernel and through
    PyTorch: the same tokens and top-logprob tokens, logprobs equal to rounding."""
    prompts = ["the quick brown fox", "paged attention", "a b c d e f"]
    params = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]

    def run():
        outs = LLM(str(llama_path), dtype="float32", seed=0).generate(prompts, params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    fast = run()
    monkeypatch.setattr(native, "argmax_logsumexp", lambda logits, with_lse=True: None)
    slow = run()
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        assert (a.cumulative_logprob is None) == (b.cumulative_logprob is None)
        if a.cumulative_logprob is not None:
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
        if a.logprobs is not None:
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys()
                assert all(la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5) for t in la)


@needs_kernel
def test_wrong_shapes_are_refused_with_a_message():
    k_cache, v_cache = (torch.zeros(s) for s in kv_shapes(8, 16, 2, 64))
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    scratch = native.scratch_for(4, 64, 16, 1)
    with pytest.raises(ValueError, match="do not fit a pool"):  # head_dim 32 queries, 64-wide pool
        native.paged_decode_attention(torch.zeros(1, 4, 32), k_cache, v_cache, tables, lens, scratch, 1.0)
    with pytest.raises(ValueError, match="do not fit a pool"):  # 3 query heads over 2 KV heads
        native.paged_prefill_attention(torch.zeros(5, 3, 64), k_cache, v_cache, tables[0], 0, 1.0)
    with pytest.raises(ValueError, match="cannot hold"):  # one block of 16 for 20 tokens
        native.paged_prefill_attention(torch.zeros(20, 4, 64), k_cache, v_cache, tables[0], 0, 1.0)
    with pytest.raises(ValueError, match="one length per query"):
        native.paged_decode_attention(torch.zeros(2, 4, 64), k_cache, v_cache, tables, lens, scratch, 1.0)
    with pytest.raises(ValueError, match="out must be"):  # an output buffer of another dtype
        native.paged_decode_attention(torch.zeros(1, 4, 64), k_cache, v_cache, tables, lens, scratch, 1.0,
                                      out=torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    # A value pool laid out token-major (the layout before head-major values) would be read as garbage.
    token_major = torch.zeros(8, 16, 2, 64)
    with pytest.raises(ValueError, match="value pool .* does not match the key pool"):
        native.paged_decode_attention(torch.zeros(1, 4, 64), k_cache, token_major, tables, lens, scratch, 1.0)
    with pytest.raises(ValueError, match="value pool .* does not match the key pool"):
        native.paged_prefill_attention(torch.zeros(5, 4, 64), k_cache, token_major, tables[0], 0, 1.0)


@needs_kernel
def test_the_first_build_is_announced_with_its_time(tmp_path):
    # A compiler stand-in that copies the library this session built: the messages are under test,
    # not the compiler's 10-35 s.
    built = native.load()._name
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo stand-in 1.0; exit 0; fi\n'
                  f'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then cp "{built}" "$2"; fi; shift; done\n')
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "PAGELLM_CACHE_DIR": str(tmp_path / "cache")}
    probe = ("import logging; logging.basicConfig(level='INFO')\n"
             "from pagellm.kernels import native\nassert native.load() is not None")
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "compiling native CPU kernels for this CPU (first run only) ..." in first.stderr
    assert re.search(r"compiled the native CPU kernels in \d+\.\d s", first.stderr)
    again = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "compiling" not in again.stderr  # cached: nothing to announce
