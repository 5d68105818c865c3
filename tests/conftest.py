"""Shared fixtures: tiny random checkpoints saved with transformers, loaded through pagellm's real loader."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from pagellm.model.default_model import build_checkpoint

torch.set_num_threads(min(2, os.cpu_count() or 1))

# What the suite prepares (GGUF files' folders, the tiny default model) goes to a private folder that is
# removed at exit, whatever PAGELLM_CACHE_DIR the user set: set before any test module is collected
# (test modules ask for the kernels at import). The compiled kernels alone are shared with the user's
# cache, where `pagellm serve` would build the same library (keyed by sources, flags, compiler and CPU),
# so that a test session does not rebuild them.
_user_cache = Path(os.environ.get("PAGELLM_CACHE_DIR")
                   or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagellm")
_cache = Path(tempfile.mkdtemp(prefix="pagellm-test-cache-"))
os.environ["PAGELLM_CACHE_DIR"] = str(_cache)
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
try:
    (_user_cache / "kernels").mkdir(parents=True, exist_ok=True)
    (_cache / "kernels").symlink_to(_user_cache / "kernels", target_is_directory=True)
except OSError:  # an unwritable home: the kernels are built into the private folder
    pass

# name -> (architecture, config overrides). Larger init std makes random logits peaked,
# so greedy choices are far from ties and parity checks are meaningful.
CHECKPOINTS = {
    "llama": ("llama", dict(initializer_range=0.2)),
    "llama-gqa-rope": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.2,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "qwen2": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.2)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=4096, initializer_range=0.2)),
    # head_dim 64: the shapes the native prefill kernel takes (with block_size 16), MHA and GQA.
    "llama-hd64": ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                 initializer_range=0.2)),
    "qwen2-hd64-gqa": ("qwen2", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                     intermediate_size=256, tie_word_embeddings=True, initializer_range=0.2)),
    # Long context for the chunked-prefill tests.
    "llama-long": ("llama", dict(initializer_range=0.2, max_position_embeddings=8192)),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(root / name, arch, seed=0, **cfg) for name, (arch, cfg) in CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def llama_path(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]

