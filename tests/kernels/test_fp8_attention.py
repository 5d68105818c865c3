"""The native attention kernels on fp8 pools (--kv-cache-dtype fp8 / fp8_e5m2): what they write is
PyTorch's own conversion to the bit, and what they compute is the float32 kernels' result on the same
values widened, to the bit."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import native
from pagellm.model.attention import AttentionMetadata
from pagellm.worker.cache_engine import kv_shapes
from tests.kernels.test_native import _cache_with_history

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler on this machine")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def as_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's conversion after a clamp to the format's largest finite value."""
    largest = torch.finfo(dtype).max
    return x.float().clamp(-largest, largest).to(dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_writes_round_as_pytorch_does_and_saturate(fp8, source):
    kv_heads, d, bs = 2, 32, 16
    # Every magnitude from the subnormals to past the largest value, and the exact edges.
    x = torch.cat([torch.randn(3000) * torch.logspace(-6, 6, 3000),
                   torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, -1e9, 57344.0, 61440.0, 2.0**-9, 2.0**-10,
                                 3 * 2.0**-11, 2.0**-16, 2.0**-17])])
    x = torch.cat([x, torch.zeros(-x.numel() % (kv_heads * d))]).to(source)
    k = x.view(-1, kv_heads, d)
    v = k.flip(0).contiguous()
    n = k.shape[0]
    k_cache, v_cache = (torch.zeros(s, dtype=fp8) for s in kv_shapes(-(-n // bs) + 1, bs, kv_heads, d))
    slots = torch.randperm(k_cache.shape[0] * bs)[:n]
    assert native.write_kv(k, v, k_cache, v_cache, slots)
    blocks, offsets = slots // bs, slots % bs
    got_k = k_cache[blocks, :, :, offsets]  # [n, kv_heads, d]
    got_v = v_cache[blocks, :, offsets, :]
    assert torch.equal(got_k.view(torch.uint8), as_fp8(k, fp8).view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), as_fp8(v, fp8).view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("block_size", "d"), [(16, 64), (16, 128), (5, 64)])  # (16: the vector path)
@pytest.mark.parametrize("window", [None, 7])
def test_decode_over_fp8_pools_is_the_float32_kernel_on_the_widened_values(fp8, block_size, d, window):
    lens, heads, kv_heads = [1, 16, 17, 40, 300], 6, 2
    k32, v32, tables, _, _ = _cache_with_history(lens, block_size, kv_heads, d, torch.float32, num_blocks=128)
    k8, v8 = as_fp8(k32, fp8), as_fp8(v32, fp8)
    q = torch.randn(len(lens), heads, d)
    lens_t = torch.tensor(lens)
    scratch = native.scratch_for(heads, d, block_size, tables.shape[1])
    got = native.paged_decode_attention(q, k8, v8, tables, lens_t, scratch, d**-0.5, window)
    want = native.paged_decode_attention(q, k8.float(), v8.float(), tables, lens_t, scratch, d**-0.5, window)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # bfloat16 queries and outputs (a bfloat16 model's), over the same pools
    q16 = q.to(torch.bfloat16)
    got16 = native.paged_decode_attention(q16, k8, v8, tables, lens_t, scratch, d**-0.5, window)
    want16 = native.paged_decode_attention(q16.float(), k8.float(), v8.float(), tables, lens_t, scratch, d**-0.5,
                                           window)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, want16.to(torch.bfloat16))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("cached", [0, 21])
def test_prefill_over_fp8_pools_is_the_float32_kernel_on_the_widened_values(fp8, cached):
    heads, kv_heads, d, bs, q_len = 4, 2, 64, 16, 37
    total = cached + q_len
    k32, v32 = (torch.zeros(s) for s in kv_shapes(8, bs, kv_heads, d))
    table = torch.tensor([5, 2, 7, 0], dtype=torch.int64)
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(total)])
    meta = AttentionMetadata(slot_mapping=slots, slot_blocks=slots // bs, slot_offsets=slots % bs)
    k, v = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    k8, v8 = (torch.zeros(s, dtype=fp8) for s in kv_shapes(8, bs, kv_heads, d))
    assert native.write_kv(k, v, k8, v8, meta.slot_mapping)
    q = torch.randn(q_len, heads, d)
    got = native.paged_prefill_attention(q, k8, v8, table, cached, d**-0.5)
    want = native.paged_prefill_attention(q, k8.float(), v8.float(), table, cached, d**-0.5)
    assert torch.equal(got, want)


def test_float16_keys_and_values_are_written_as_their_float32_values():
    k = (torch.randn(5, 2, 64) * 30).to(torch.float16)
    v = (torch.randn(5, 2, 64) * 30).to(torch.float16)
    k_cache, v_cache = (torch.zeros(s, dtype=torch.float8_e4m3fn) for s in kv_shapes(2, 16, 2, 64))
    slots = torch.tensor([3, 17, 4, 30, 0])
    assert native.write_kv(k, v, k_cache, v_cache, slots)
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(k_cache[blocks, :, :, offsets].view(torch.uint8), as_fp8(k, k_cache.dtype).view(torch.uint8))
    assert torch.equal(v_cache[blocks, :, offsets, :].view(torch.uint8), as_fp8(v, v_cache.dtype).view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
def test_nan_is_stored_as_nan_and_read_back_as_nan(fp8):
    k = torch.randn(1, 1, 64)
    k[0, 0, 5] = float("nan")
    v = -k
    k_cache, v_cache = (torch.zeros(s, dtype=fp8) for s in kv_shapes(1, 16, 1, 64))
    assert native.write_kv(k, v, k_cache, v_cache, torch.tensor([0]))
    assert k_cache[0, 0, 5, 0].float().isnan() and v_cache[0, 0, 0, 5].float().isnan()
    q = torch.randn(1, 2, 64)
    scratch = native.scratch_for(2, 64, 16, 1)
    out = native.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0]]), torch.tensor([1]), scratch, 0.125)
    assert out.isnan().all()  # as PyTorch's attention over the same values
