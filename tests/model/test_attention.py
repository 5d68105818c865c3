"""Paged attention against dense attention over the same keys and values, for each backend.

Each case caches some history per sequence (written through ``write_kv`` at scattered blocks),
then runs one step with decodes (one new token) and prefills (fresh, or a chunk after cached
context) in the same flat batch, and compares every output row with a dense reference.
"""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import native
from pagellm.model.attention import (
    BACKENDS,
    BAG_MIN_BLOCK_SIZE,
    AttentionConfig,
    AttentionMetadata,
    DecodeGroups,
    NativeAttentionBackend,
    PrefillSpan,
    TorchAttentionBackend,
    cascade_runs,
    choose_output_rows,
    select_attention_backend,
    write_kv,
)
from pagellm.worker.cache_engine import kv_shapes


def _meta(slots: list[int], block_size: int, window=None) -> AttentionMetadata:
    s = torch.tensor(slots, dtype=torch.long)
    return AttentionMetadata(slot_mapping=s, slot_blocks=s // block_size, slot_offsets=s % block_size,
                             sliding_window=window)


def _reference(q, keys, values, q_positions, window, scale):
    """q: (q_len, heads, d); keys/values: (ctx, kv_heads, d) for positions 0..ctx-1."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (heads, ctx, d)
    values = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # (heads, q_len, ctx)
    k_pos = torch.arange(keys.shape[1]).unsqueeze(0)
    qp = torch.tensor(q_positions).unsqueeze(1)
    allowed = k_pos <= qp
    if window is not None:
        allowed &= k_pos > qp - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(-1), values).transpose(0, 1)  # (q_len, heads, d)


@pytest.mark.parametrize("block_size", [1, 3, 8, 16])  # 1 and 3 gather keys, 8 and 16 score them in place
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("backend_class", BACKENDS, ids=lambda b: b.name)
def test_paged_attention_matches_dense(block_size, heads, kv_heads, window, backend_class):
    torch.manual_seed(0)
    d, num_blocks = 8, 64
    config = AttentionConfig(torch.device("cpu"), torch.float32, heads, kv_heads, d, block_size, window)
    if backend_class.unsupported(config) is not None:
        pytest.skip(backend_class.unsupported(config))
    backend = backend_class(config)
    k_cache, v_cache = (torch.zeros(s) for s in kv_shapes(num_blocks, block_size, kv_heads, d))
    free = torch.randperm(num_blocks).tolist()  # scattered blocks, as a real pool hands them out
    # (cached tokens before this step, new tokens this step): three decodes of unlike lengths
    # (two decode groups), a prefill chunk after cached context, and a fresh prefill.
    shapes = [(20, 1), (17, 1), (4, 1), (6, 5), (0, 7)]
    seqs = []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(total)]
        k = torch.randn(total, kv_heads, d)
        v = torch.randn(total, kv_heads, d)
        if cached:
            backend.write_kv(k[:cached], v[:cached], k_cache, v_cache, _meta(slots[:cached], block_size))
        seqs.append((cached, new, table, slots, k, v))

    scale = d**-0.5
    q_rows, k_new, v_new, step_slots, prefills, expected = [], [], [], [], [], []
    for cached, new, table, slots, k, v in seqs:
        q = torch.randn(new, heads, d)
        if new > 1:
            prefills.append(PrefillSpan(len(step_slots), new, cached + new, torch.tensor(table)))
        q_rows.append(q)
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        step_slots.extend(slots[cached:])
        expected.append(_reference(q, k, v, list(range(cached, cached + new)), window, scale))
    meta = _meta(step_slots, block_size, window)
    meta.prefills = prefills
    # Decodes are rows 0..2, sorted longest first.
    meta.decode = backend.prepare_decode([seqs[i][2] for i in range(3)], [seqs[i][0] + 1 for i in range(3)], [])
    assert meta.num_decodes == 3
    if isinstance(meta.decode, DecodeGroups):  # two groups: [20, 17] and [4]
        assert [(g.start, g.num) for g in meta.decode.groups] == [(0, 2), (2, 1)]
        assert all((g.key_rows is None) == (block_size < BAG_MIN_BLOCK_SIZE) for g in meta.decode.groups)
    out = backend.forward(torch.cat(q_rows), torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_the_backend_is_chosen_from_device_dtype_and_kernels(monkeypatch):
    """The native kernels take float32 and bfloat16 CPU pools; everything else is PyTorch's."""
    def chosen(dtype, block_size=16, head_dim=64, window=None):
        config = AttentionConfig(torch.device("cpu"), dtype, 4, 2, head_dim, block_size, window)
        return select_attention_backend(config)

    assert type(chosen(torch.float16)) is TorchAttentionBackend
    assert NativeAttentionBackend.unsupported(
        AttentionConfig(torch.device("meta"), torch.float32, 4, 2, 64, 16)) is not None
    if native.load() is not None:
        backend = chosen(torch.float32)
        assert type(backend) is NativeAttentionBackend and backend.native_prefill and not backend.cascade
        assert not chosen(torch.float32, block_size=8).native_prefill  # (the prefill kernel's shapes)
        assert not chosen(torch.float32, head_dim=32).native_prefill
        # Shared-prefix decode needs the bfloat16 dot products, and no window.
        assert not chosen(torch.bfloat16, window=64).cascade
        bf16_pool = torch.empty(0, 2, 64, 16, dtype=torch.bfloat16)
        assert chosen(torch.bfloat16).cascade == native.cascade_supported(bf16_pool)
    monkeypatch.setattr(native, "load", lambda: None)  # no kernels (no compiler, or turned off)
    assert type(chosen(torch.float32)) is TorchAttentionBackend


def test_the_native_backend_raises_where_its_kernel_does_not_write(monkeypatch):
    if native.load() is None:
        pytest.skip("no C compiler on this machine")
    backend = NativeAttentionBackend(AttentionConfig(torch.device("cpu"), torch.float32, 2, 2, 4, 4))
    k_cache, v_cache = (torch.zeros(s) for s in kv_shapes(8, 4, 2, 4))
    k = torch.randn(3, 2, 4, dtype=torch.float64)  # not the pools' dtype
    with pytest.raises(ValueError, match="native write_kv does not take"):
        backend.write_kv(k, k, k_cache, v_cache, _meta([0, 1, 2], 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "pytorch"])
@pytest.mark.parametrize("num_tokens", [3, 100])  # 100: the native kernel spreads tokens over threads
def test_write_kv_stores_each_token_at_its_slot(dtype, path, num_tokens, monkeypatch):
    if path == "pytorch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("no C compiler on this machine")
    block_size, kv_heads, d, num_blocks = 4, 2, 3, 40
    k_cache, v_cache = (torch.zeros(s, dtype=dtype) for s in kv_shapes(num_blocks, block_size, kv_heads, d))
    # K and V as the model hands them over: views into one fused row per token.
    fused = torch.randn(num_tokens, 3 * kv_heads * d).to(dtype)
    k = fused[:, kv_heads * d : 2 * kv_heads * d].view(num_tokens, kv_heads, d)
    v = fused[:, 2 * kv_heads * d :].view(num_tokens, kv_heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:num_tokens].tolist()
    write_kv(k, v, k_cache, v_cache, _meta(slots, block_size))
    for i, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, :, :, offset], k[i])  # keys: (blocks, heads, d, block_size)
        assert torch.equal(v_cache[block, :, offset], v[i])  # values: (blocks, heads, block_size, d)
    assert int((k_cache != 0).sum()) == int((k != 0).sum())  # nothing written elsewhere


def test_cascade_runs_are_adjacent_runs_and_what_all_their_tables_start_with():
    tables = [[7, 8, 9, 1], [7, 8, 9], [7, 8, 2], [5, 6], [3, 4], [5, 6, 10], [11], [11, 12]]
    # 7-8-9-1 / 7-8-9 / 7-8-2 share 7, 8; the 5-6 tables are not adjacent; 11 is all of the first table.
    assert cascade_runs(tables) == [(0, 3, 2), (6, 8, 1)]
    assert cascade_runs([[1, 2], [3, 4]]) == [] and cascade_runs([[1, 2]]) == [] and cascade_runs([]) == []


def test_output_rows_keep_every_decode_and_each_prefill_from_its_first_used_row():
    # Rows: 2 decodes, a 5-token prefill (only its last row sampled), a 4-token chunk that samples
    # nothing, a 6-token prefill scored from its third row.
    meta = _meta(list(range(100, 117)), 16)
    tables = [torch.tensor([6]), torch.tensor([7]), torch.tensor([8])]
    meta.prefills = [PrefillSpan(2, 5, 9, tables[0]), PrefillSpan(7, 4, 4, tables[1]), PrefillSpan(11, 6, 6, tables[2])]
    # Any order, repeats (forks sampling the same row).
    kept = choose_output_rows(meta, 17, 2, [16, 6, 6, 0, 13, 1, 14, 15])
    assert kept.rows == kept.index.tolist() == [0, 1, 6, 13, 14, 15, 16]
    assert [(s.q_start, s.q_len, s.context_len) for s in kept.meta.prefills] == [(2, 1, 9), (3, 4, 6)]
    assert kept.meta.prefills[0].block_table is tables[0] and kept.meta.prefills[1].block_table is tables[2]
    assert kept.meta.slot_mapping.tolist() == [100, 101, 106, 113, 114, 115, 116]
    assert kept.meta.output_rows is None and kept.meta.sliding_window == meta.sliding_window
    assert kept.positions([16, 6, 6, 0]) == [6, 2, 2, 0]
    # Every row used: nothing to cut.
    assert choose_output_rows(meta, 17, 2, list(range(17))) is None
    # A step holding only a chunk that samples nothing keeps no row.
    only_chunk = _meta(list(range(4)), 16)
    only_chunk.prefills = [PrefillSpan(0, 4, 4, tables[1])]
    empty = choose_output_rows(only_chunk, 4, 0, [])
    assert empty.rows == [] and empty.index.numel() == 0 and empty.meta.prefills == []
