"""EngineArgs and memory sizes."""

from __future__ import annotations

import pytest

from pagellm.config import EngineArgs, parse_memory


@pytest.mark.parametrize(
    "text, expected",
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1e9", 10**9), (4096, 4096), ("8 kib", 8192)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "-1GiB", 0, True])
def test_parse_memory_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory(bad)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("max_num_seqs", 0, "max_num_seqs"),
        ("max_model_len", -5, "max_model_len"),
        ("num_kv_blocks", 1.5, "num_kv_blocks"),
        ("kv_cache_memory", "huge", r"kv_cache_memory \(--kv-cache-memory\): memory size"),
        ("dtype", "fp8", "dtype"),
        ("load_format", "pt", "load_format"),
        ("seed", "x", r"seed \(--seed\) must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
        ("seed", 2**70, r"seed \(--seed\) must be an integer in"),
        ("enable_prefix_caching", "no", r"enable_prefix_caching \(--enable-prefix-caching\) must be True or False"),
        ("block_size", True, "block_size"),
        ("swap_space", float("inf"), "swap_space .* finite"),
    ],
)
def test_engine_args_validation_names_the_flag(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{field: value})
