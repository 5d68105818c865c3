"""Declare and call the C kernels (``csrc/``; built and loaded by ``build.py``).

``load()`` returns the compiled library with every function's ``ctypes`` signature declared, or None
where the kernels are disabled (``PAGELLM_NATIVE_KERNELS=0``) or cannot be built or loaded (no
compiler, no OpenMP, an unwritable cache folder: warned once), and callers use their PyTorch path. The
functions below check their arguments and call the kernels, or report that the kernel does not apply.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagellm.kernels import build
from pagellm.kernels.build import COMPILE_FLAGS, LINK_FLAGS, cache_dir, cpu_flags  # noqa: F401 (re-exported)

# What ``load()`` compiles: the folder of C files (or one C file: benchmarks/kernel_ab.py points this at
# another revision's kernels).
SOURCE = build.SOURCE_DIR
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # enum in csrc/cpu_kernels.h
# The pools' element types: those, and fp8 (--kv-cache-dtype; queries and outputs in the model's dtype).
POOL_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, built if needed; None when disabled or when they cannot be built."""
    return build.load_library(SOURCE, _declare)


def _lib() -> ctypes.CDLL:
    """``load()`` where the caller checked that it is not None (``supports``, ``_applies``, ...)."""
    lib = load()
    assert lib is not None, "native kernels are not loaded: check supports() first"
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pagellm_scratch_floats.restype = i64
    lib.pagellm_scratch_floats.argtypes = [i64, i64, i64, i64]
    lib.pagellm_paged_decode_attention.restype = None
    lib.pagellm_paged_decode_attention.argtypes = (
        [ptr, i64, *[ptr] * 5, *[i64] * 7, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr, i64])
    lib.pagellm_prefill_scratch_floats.restype = i64
    lib.pagellm_prefill_scratch_floats.argtypes = [i64, i64, i64]
    lib.pagellm_paged_prefill_attention.restype = ctypes.c_int
    lib.pagellm_paged_prefill_attention.argtypes = (
        [ptr, i64, ptr, ptr, ptr, ptr, *[i64] * 7, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr])
    lib.pagellm_bf16_dot_products.restype = ctypes.c_int
    lib.pagellm_bf16_dot_products.argtypes = [ctypes.c_int]
    lib.pagellm_write_kv.restype = None
    lib.pagellm_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.pagellm_write_kv_converted.restype = ctypes.c_int
    lib.pagellm_write_kv_converted.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_int]
    lib.pagellm_argmax_logsumexp.restype = None
    lib.pagellm_argmax_logsumexp.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.pagellm_rms_norm.restype = None
    lib.pagellm_rms_norm.argtypes = [ptr] * 5 + [i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.pagellm_silu_and_mul.restype = None
    lib.pagellm_silu_and_mul.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.pagellm_rotary.restype = None
    lib.pagellm_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.pagellm_linear_bf16_supported.restype = ctypes.c_int
    lib.pagellm_linear_bf16_supported.argtypes = []
    lib.pagellm_linear_packed_words.restype = i64
    lib.pagellm_linear_packed_words.argtypes = [i64, i64, ctypes.c_int]
    lib.pagellm_pack_linear_weight.restype = None
    lib.pagellm_pack_linear_weight.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    lib.pagellm_linear_bf16.restype = ctypes.c_int
    lib.pagellm_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.pagellm_quant_row_bytes.restype = i64
    lib.pagellm_quant_row_bytes.argtypes = [ctypes.c_int, i64]
    for quant_linear in (lib.pagellm_quant_linear, lib.pagellm_quant_linear_int8, lib.pagellm_quant_linear_panel):
        quant_linear.restype = ctypes.c_int
        quant_linear.argtypes = [ptr, i64, ctypes.c_int, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr, i64, ctypes.c_int,
                                 ctypes.c_int]
    lib.pagellm_dequantize.restype = ctypes.c_int
    lib.pagellm_dequantize.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ctypes.c_int]
    lib.pagellm_decode_layers_quantized.restype = ctypes.c_int
    lib.pagellm_decode_layers_quantized.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int,
                                                    ctypes.c_int]
    lib.pagellm_decode_layers.restype = ctypes.c_int
    lib.pagellm_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, ctypes.c_int]


def prefill_supported(k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention`` was written for this pool's shape (block_size 16, head_dim 64 or
    128) and dtype; otherwise prefill uses PyTorch's flash kernel."""
    _, _, head_dim, block_size = k_cache.shape
    return block_size == 16 and head_dim in (64, 128) and supports(k_cache.device, k_cache.dtype)


def cascade_supported(k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` reads blocks shared by several decodes once (its ``cascade``):
    bfloat16 pools of block_size 16 and head_dim 64 or 128, on the CPU's bfloat16 dot products."""
    return (k_cache.dtype == torch.bfloat16 and prefill_supported(k_cache)
            and _lib().pagellm_bf16_dot_products(-1) > 0)


def paged_prefill_attention(
    q: torch.Tensor,  # (q_len, num_heads, head_dim): heads contiguous, any stride between tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (num_blocks_of_seq,) int64
    cached: int,  # tokens before these in the sequence: query i is at position cached + i
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's new tokens attending causally over the pool, their own K/V already written there;
    returns (q_len, num_heads, head_dim) in the cache's dtype: ``out`` when it is given (contiguous,
    that shape and dtype). Check ``prefill_supported`` first."""
    q_len, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    dtype = compute_dtype(q, k_cache)
    q = _query_for(q, k_cache, v_cache, any_token_stride=True)
    if block_table.numel() * block_size < cached + q_len:
        raise ValueError(f"block table of {block_table.numel()} blocks cannot hold {cached + q_len} tokens")
    table = block_table.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    lib = _lib()
    scratch = torch.empty(threads * lib.pagellm_prefill_scratch_floats(num_heads, num_kv_heads, head_dim),
                          dtype=torch.float32)
    if out is None:
        out = torch.empty(q_len, num_heads, head_dim, dtype=dtype)
    elif out.shape != q.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(q.shape)}")
    status = lib.pagellm_paged_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), out.data_ptr(),
        q_len, cached, num_heads, num_kv_heads, head_dim, block_size, window or 0, scale, DTYPE_CODES[dtype],
        POOL_CODES[k_cache.dtype], threads, scratch.data_ptr())
    if status != 0:
        raise ValueError(f"native prefill attention does not take block_size {block_size} / head_dim {head_dim}")
    return out


def use_bf16_dot_products(enable: bool) -> bool | None:
    """Attention (decode and prefill) on bfloat16 pools: the CPU's bfloat16 dot products (True, the
    default where the CPU has AVX512-BF16) or the portable paths (False; decode then gives the float32
    path's bits). Process-wide: switch only while no kernel runs. Returns the previous setting, or None
    where there are no such instructions (or no kernels)."""
    lib = load()
    before = -1 if lib is None else lib.pagellm_bf16_dot_products(int(enable))
    return None if before < 0 else bool(before)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Store each token's K/V (num_tokens, num_kv_heads, head_dim; heads contiguous, any stride between
    tokens) at its slot of the pools (laid out as ``pagellm.model.attention`` describes; slots within
    them). False where the kernel does not apply (device, dtype, no kernel): the caller uses PyTorch."""
    n, num_kv_heads, head_dim = k.shape
    dtype = k_cache.dtype
    converted = dtype not in DTYPE_CODES  # fp8 pools: K/V in the model's dtype, rounded as they are stored
    if converted and k.dtype == v.dtype == torch.float16:
        k, v = k.float(), v.float()  # (the kernel widens float32 and bfloat16)
    source_ok = k.dtype in DTYPE_CODES if converted else k.dtype == dtype
    if (k_cache.device.type != "cpu" or dtype not in POOL_CODES or load() is None
            or not source_ok or v.dtype != k.dtype or v_cache.dtype != dtype or v.shape != k.shape
            or tuple(k_cache.shape[1:3]) != (num_kv_heads, head_dim)
            or tuple(v_cache.shape) != (k_cache.shape[0], num_kv_heads, k_cache.shape[3], head_dim)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape != (n,)
            or any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (k, v))):
        return False
    common = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), n, k_cache.data_ptr(),
              v_cache.data_ptr(), num_kv_heads, head_dim, k_cache.shape[3])
    if n and converted:
        if _lib().pagellm_write_kv_converted(*common, DTYPE_CODES[k.dtype], POOL_CODES[dtype], torch.get_num_threads()):
            raise MemoryError(f"native write_kv: no memory for {n} tokens' K/V")
    elif n:
        _lib().pagellm_write_kv(*common, k.element_size(), torch.get_num_threads())
    return True


def argmax_logsumexp(logits: torch.Tensor,
                     with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per row of (rows, vocab) float32 CPU logits: (first argmax, logsumexp or None without
    ``with_lse``), or None where the kernel does not apply (other device or dtype, or no kernel), for
    the caller's PyTorch path."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or load() is None:
        return None
    logits = logits.contiguous()
    rows, vocab = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32) if with_lse else None
    if rows and vocab:
        _lib().pagellm_argmax_logsumexp(logits.data_ptr(), rows, vocab, idx.data_ptr(),
                                        None if lse is None else lse.data_ptr(), torch.get_num_threads())
    return idx, lse


def compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The attention kernels' query and output dtype: the pools', or for fp8 pools the query's
    (float32 where that is neither float32 nor bfloat16)."""
    if k_cache.dtype in DTYPE_CODES:
        return k_cache.dtype
    return q.dtype if q.dtype in DTYPE_CODES else torch.float32


def _query_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, any_token_stride: bool) -> torch.Tensor:
    """Checks that q (tokens, heads, head_dim) fits the pools, and returns it in ``compute_dtype`` with
    its heads contiguous (and its tokens too, unless the kernel takes any stride between tokens)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, dtype = k_cache.shape[1], compute_dtype(q, k_cache)
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim:
        raise ValueError(f"{num_heads} query heads of {head_dim} do not fit a pool of {num_kv_heads} KV heads "
                         f"of {k_cache.shape[2]}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
        raise ValueError("native attention needs contiguous K/V pools of one dtype")
    num_blocks, _, _, block_size = k_cache.shape
    if tuple(v_cache.shape) != (num_blocks, num_kv_heads, block_size, head_dim):
        raise ValueError(f"value pool {tuple(v_cache.shape)} does not match the key pool {tuple(k_cache.shape)}: "
                         f"want (num_blocks, num_kv_heads, block_size, head_dim) as kv_shapes lays it out")
    heads_contiguous = q.stride(2) == 1 and q.stride(1) == head_dim
    if q.dtype != dtype or not heads_contiguous or not (any_token_stride or q.is_contiguous()):
        q = q.to(dtype).contiguous()
    return q


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention for a KV cache of this device and dtype can use the native kernel."""
    return device.type == "cpu" and dtype in POOL_CODES and load() is not None


def scratch_for(num_heads: int, head_dim: int, block_size: int, max_blocks: int) -> torch.Tensor:
    """The kernel's per-thread working memory for one step (shared by every layer)."""
    per_thread = _lib().pagellm_scratch_floats(num_heads, head_dim, block_size, max_blocks)
    return torch.empty(torch.get_num_threads() * per_thread, dtype=torch.float32)


def scratch_enough(scratch: torch.Tensor, num_heads: int, head_dim: int, block_size: int,
                   max_blocks: int) -> torch.Tensor:
    """``scratch``, or a larger one where the thread count was raised since it was made."""
    per_thread = _lib().pagellm_scratch_floats(num_heads, head_dim, block_size, max_blocks)
    needed = torch.get_num_threads() * per_thread
    return scratch if scratch.numel() >= needed else torch.empty(needed, dtype=torch.float32)


# Elements per thread below which a kernel runs on fewer threads: waking a thread costs more
# than it saves on a decode's few rows, and a busy machine may not run the woken thread for a whole
# time slice, which every other thread of the team then waits for.
ELEMENTS_PER_THREAD = 32768


def _threads_for(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // ELEMENTS_PER_THREAD))


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim): heads contiguous, any stride between sequences
    k_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_dim, block_size)
    v_cache: torch.Tensor,  # (num_blocks, num_kv_heads, block_size, head_dim)
    tables: torch.Tensor,  # (num_seqs, max_blocks) int64, padded with any valid block id
    lens: torch.Tensor,  # (num_seqs,) int64 context lengths, >= 1
    scratch: torch.Tensor,  # from scratch_for(...)
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    cascade: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its own blocks; returns (num_seqs, num_heads, head_dim) in the
    cache's dtype: ``out`` when it is given (contiguous, that shape and dtype). Block ids and lengths are
    the engine's (each length >= 1 and covered by its row of ``tables``); shapes are checked here.
    ``cascade``: (runs, 3) int64 rows (begin, end, shared), as ``attention.cascade_runs`` finds
    them: sequences ``begin..end-1`` hold the same first ``shared`` blocks, read once for the run
    (bfloat16 pools with the dot products and no window; elsewhere each sequence reads them itself).
    The output is the same bits with or without it."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size = k_cache.shape
    dtype = compute_dtype(q, k_cache)
    q = _query_for(q, k_cache, v_cache, any_token_stride=True)
    if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
        raise ValueError(f"need one block-table row and one length per query: q {tuple(q.shape)}, "
                         f"tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
    if (tables.dtype != torch.int64 or lens.dtype != torch.int64
            or not (tables.is_contiguous() and lens.is_contiguous())):
        raise ValueError("block tables and context lengths must be contiguous int64 tensors")
    scratch = scratch_enough(scratch, num_heads, head_dim, block_size, tables.shape[1])
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    elif out.shape != q.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(q.shape)}")
    if cascade is not None:
        if (cascade.dtype != torch.int64 or cascade.dim() != 2 or cascade.shape[1] != 3
                or not cascade.is_contiguous()):
            raise ValueError(f"cascade must be a contiguous (runs, 3) int64 tensor, got {cascade.dtype} "
                             f"{tuple(cascade.shape)}")
        # The kernel reads the shared blocks of each run through its first table: they must exist for
        # every member (that the members' tables hold the same ids there is the caller's to ensure).
        runs, lengths, done = cascade.tolist(), lens.tolist(), 0
        for begin, end, shared in runs:
            if not (done <= begin < end <= num_seqs and 1 <= shared <= -(-min(lengths[begin:end]) // block_size)):
                raise ValueError(f"cascade rows must be ordered, disjoint runs (begin, end, shared) of the "
                                 f"{num_seqs} sequences sharing 1 <= shared <= their blocks; got {runs}")
            done = end
    _lib().pagellm_paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1], window or 0, scale,
        DTYPE_CODES[dtype], POOL_CODES[k_cache.dtype],
        _threads_for(2 * num_seqs * num_heads * tables.shape[1] * block_size * head_dim),
        scratch.data_ptr(), None if cascade is None else cascade.data_ptr(), 0 if cascade is None else cascade.shape[0])
    return out


# ------------------------------------------------------------------ element-wise layers
# Each reports where the kernel does not apply (not a contiguous float32/bfloat16 CPU tensor, or no
# kernel), and the caller runs its PyTorch code, which computes the same values (RMSNorm: to rounding).


def _applies(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    return (t.device.type == "cpu" and t.dtype in DTYPE_CODES and all(
        x.dtype == t.dtype and x.is_contiguous() for x in tensors) and load() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, the norm in float32. With
    ``residual``: ``residual`` becomes x + residual (in place) and that sum is normed. None where the
    kernel does not apply (nothing changed)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not _applies(*tensors) or x.shape[-1] != weight.numel() or (residual is not None and residual.shape != x.shape):
        return None
    out = torch.empty_like(x)
    hidden = weight.numel()
    add = None if residual is None else residual.data_ptr()
    _lib().pagellm_rms_norm(x.data_ptr(), add, add, weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden,
                            eps, DTYPE_CODES[x.dtype], _threads_for(x.numel()))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for rows [gate | up] of (num_tokens, 2 * inter), as PyTorch rounds its two ops
    (to an ulp of the exponential); None where the kernel does not apply."""
    if not _applies(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    if rows:
        _lib().pagellm_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, DTYPE_CODES[gate_up.dtype],
                                    _threads_for(gate_up.numel()))
    return out


def rotary_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> bool:
    """Rotate, in place, the first ``heads`` heads of every row of ``qkv`` (num_tokens, width) by the
    float32 tables ``cos``/``sin`` (max_position, head_dim) at ``positions`` (each below max_position,
    as the engine guarantees). False: not applied."""
    if (not _applies(qkv) or qkv.dim() != 2 or positions.dtype != torch.int64 or not positions.is_contiguous()
            or positions.shape != (qkv.shape[0],) or heads * head_dim > qkv.shape[1] or head_dim % 2
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape[-1] != head_dim
            or not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape)):
        return False
    _lib().pagellm_rotary(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], heads, head_dim, positions.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), DTYPE_CODES[qkv.dtype], _threads_for(qkv.numel()))
    return True


# ------------------------------------------------------------------ bfloat16 linear layers


def linear_supported() -> bool:
    """Whether ``linear_bf16`` runs here: native kernels with AVX512-BF16 and no AMX (where oneDNN's
    tile instructions are faster)."""
    lib = load()
    return lib is not None and _has_linear(lib)


@functools.cache
def _has_linear(lib: ctypes.CDLL) -> bool:  # asked once per library (every layer call checks)
    # The kernel leaves itself out where the compiler targets AMX; the CPU is asked too, since a
    # compiler too old to know AMX would not say so, and oneDNN's AMX path is far faster there.
    return bool(lib.pagellm_linear_bf16_supported()) and "amx_bf16" not in cpu_flags()


def _linear_lib() -> ctypes.CDLL:
    lib = load()
    if lib is None or not _has_linear(lib):
        raise RuntimeError("the native bfloat16 linear kernel is not available here (no native kernels, no "
                           "AVX512-BF16, or an AMX CPU): check linear_supported() first")
    return lib


# Output modes of the kernel (enum in csrc/cpu_kernels.h).
_LINEAR_BF16, _LINEAR_F32, _LINEAR_SILU_GATED = 0, 1, 2


def _packed_shape(out_features: int, in_features: int, gated: bool = False) -> tuple[int, ...]:
    """(panels of 32 weight rows, pairs of input columns, 32), or gated (panels, pairs, 2, 16): the
    packed weight's shape (the same words; the gated one says so by its shape)."""
    pairs = -(-in_features // 2)
    return (-(-out_features // 2 // 16), pairs, 2, 16) if gated else (-(-out_features // 32), pairs, 32)


def pack_linear_weight(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """A (out_features, in_features) bfloat16 weight in ``linear_bf16``'s layout: int32 words of
    shape ``(ceil(out / 32), ceil(in / 2), 32)``, word [p, j, c] = the pair (w[32p + c, 2j],
    w[32p + c, 2j + 1]) (zero past the weight's edges). ``gated``: the weight is ``[gate; up]`` (an
    even number of rows) for ``linear_bf16(..., gated=True)``, packed as ``(ceil(out / 32), ceil(in /
    2), 2, 16)``: word [p, j, 0, c] is gate row 16p + c's pair j, word [p, j, 1, c] up row 16p + c's."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"need a 2-D bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if gated and weight.shape[0] % 2:
        raise ValueError("a gated weight stacks gate and up rows: it needs an even number of rows, "
                         f"got {weight.shape[0]}")
    lib = _linear_lib()
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(_packed_shape(n, k, gated), dtype=torch.int32)
    assert packed.numel() == lib.pagellm_linear_packed_words(n, k, gated)
    lib.pagellm_pack_linear_weight(weight.data_ptr(), n, k, gated, packed.data_ptr(), torch.get_num_threads())
    return packed


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                gated: bool = False) -> torch.Tensor:
    """x (rows, in_features) bfloat16 on the CPU (any stride between rows, unit stride within) times
    the weight packed by ``pack_linear_weight``, plus ``bias`` (float32, out_features) if given:
    (rows, out_features) bfloat16, sums in float32 and rounded once. Each row's result is the same
    whatever the other rows are. With ``out_dtype=torch.float32`` the same bfloat16 values come back
    as float32 (the LM head's logits: no separate ``float()`` pass). ``gated`` (a weight packed
    gated): (rows, out_features / 2) bfloat16 ``silu(gate) * up`` of the result's two halves, the
    same bits as ``silu_and_mul`` on the bfloat16 result (the MLP's activation, without storing the
    gate and up projections and reading them back)."""
    lib = _linear_lib()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be a 2-D bfloat16 CPU tensor with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)} (strides {x.stride()}) on {x.device}")
    if out_dtype not in (torch.bfloat16, torch.float32) or (gated and out_dtype != torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.bfloat16 or (not gated) torch.float32, got {out_dtype}")
    if gated and out_features % 2:
        raise ValueError(f"a gated weight has an even number of rows (gate and up), got {out_features}")
    rows, in_features = x.shape
    if (packed.dtype != torch.int32 or packed.device.type != "cpu" or not packed.is_contiguous()
            or tuple(packed.shape) != _packed_shape(out_features, in_features, gated)):
        raise ValueError(f"the packed weight {packed.dtype} {tuple(packed.shape)} is not one of {out_features} x "
                         f"{in_features} from pack_linear_weight{'(gated=True)' if gated else ''} (shape "
                         f"{_packed_shape(out_features, in_features, gated)}): "
                         f"a weight of another shape, or x with the wrong number of columns ({in_features})")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or not bias.is_contiguous()
                             or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a contiguous float32 CPU tensor of {out_features}")
    out = torch.empty(rows, out_features // 2 if gated else out_features, dtype=out_dtype)
    mode = _LINEAR_SILU_GATED if gated else _LINEAR_F32 if out_dtype == torch.float32 else _LINEAR_BF16
    if rows and out_features:
        status = lib.pagellm_linear_bf16(x.data_ptr(), x.stride(0), rows, in_features, packed.data_ptr(), out_features,
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), mode,
                                         torch.get_num_threads())
        if status == -2:
            raise MemoryError(f"native linear: no memory for {rows} x {in_features} inputs")
        assert status == 0, status  # _linear_lib checked that the kernel is compiled in
    return out


# ------------------------------------------------------------------ decode steps in one call


class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights and KV pools for ``decode_layers`` (``pagellm_decode_layer``): the
    RMSNorm weights (bfloat16), the packed linear weights (gate_up packed gated), their float32
    biases or None, the pools."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias",
        "k_pool", "v_pool")]


class DecodeStep(ctypes.Structure):
    """A decode step's shapes, per-row inputs and work buffers for ``decode_layers``
    (``pagellm_decode_step``)."""

    _fields_ = ([(name, ctypes.c_int64) for name in (
        "rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "max_blocks", "window")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [(name, ctypes.c_void_p) for name in ("positions", "slots", "tables", "lens", "cascade")]
        + [("num_cascade", ctypes.c_int64)]
        + [(name, ctypes.c_void_p) for name in (
            "cos", "sin", "attention_scratch", "normed", "qkv", "attention", "act", "final_norm")]
        + [("final_eps", ctypes.c_float)])


def decode_layers(layers: ctypes.Array, step: DecodeStep, x: torch.Tensor, residual: torch.Tensor) -> None:
    """Every decoder layer of a decode-only step in one native call (pagellm/model/native_decode.py
    builds and checks the arguments): ``x`` (the embeddings) becomes the last layer's MLP output and
    ``residual`` the running sum before it, as the layers' ``forward`` returns them; with the step's
    ``final_norm``, ``x`` becomes the normed sum of the two and ``residual`` that sum."""
    status = _linear_lib().pagellm_decode_layers(layers, len(layers), ctypes.byref(step), x.data_ptr(),
                                                 residual.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"native decode step: no memory for {step.rows} rows")
    assert status == 0, status
