"""NomicBertModel (nomic-embed-text) against sentence-transformers over transformers' NomicBertModel on a tiny
random folder (saved with Nomic's tensor names), and the same model with Nomic's config keys or with
transformers' tensor names loading to the same embeddings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from pagellm import LLM
from pagellm.model.default_model import build_encoder_checkpoint

st = pytest.importorskip("sentence_transformers")

TEXTS = ["Hello world", "The capital of France is Paris. " * 3, "", "héllo 日本語"]


@pytest.fixture(scope="module")
def nomic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder_checkpoint(tmp_path_factory.mktemp("nomic") / "m", "nomic_bert", pooling="mean",
                                    max_seq_length=48)


def _embed(folder: Path) -> np.ndarray:
    llm = LLM(str(folder), runner="pooling")
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


def test_embeddings_equal_sentence_transformers(nomic: Path) -> None:
    ours = _embed(nomic)
    ref = st.SentenceTransformer(str(nomic), device="cpu").encode(TEXTS)
    cos = (ours * ref).sum(-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.99999, cos


def _nomic_config(native: Path, folder: Path) -> Path:
    """The folder with config.json as Nomic's remote code writes it (transformers saves Nomic's tensor names)."""
    shutil.copytree(native, folder)
    config = json.loads((native / "config.json").read_text())
    for nomic_key, key in {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                           "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
                           "n_positions": "max_position_embeddings"}.items():
        config[nomic_key] = config.pop(key)
    config.update(rotary_emb_base=config.pop("rope_parameters")["rope_theta"], activation_function="swiglu",
                  rotary_emb_fraction=1.0, prenorm=False, qkv_proj_bias=False)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_nomic_config_loads_the_same_model(nomic: Path, tmp_path: Path) -> None:
    np.testing.assert_allclose(_embed(_nomic_config(nomic, tmp_path / "orig")), _embed(nomic), atol=1e-6)


def test_transformers_tensor_names_load_the_same_model(nomic: Path, tmp_path: Path) -> None:
    """transformers' own names (separate q/k/v projections, up/gate/down) as a checkpoint may hold them."""
    from transformers import AutoModel

    folder = tmp_path / "hf"
    shutil.copytree(nomic, folder)
    state = {k: v.contiguous() for k, v in AutoModel.from_pretrained(nomic).state_dict().items()}
    assert any(".self_attn.q_proj." in k for k in state)
    save_file(state, str(folder / "model.safetensors"))
    np.testing.assert_allclose(_embed(folder), _embed(nomic), atol=1e-6)


def test_unsupported_nomic_options_are_named(nomic: Path, tmp_path: Path) -> None:
    folder = _nomic_config(nomic, tmp_path / "orig")
    config = json.loads((folder / "config.json").read_text())
    config["rotary_emb_fraction"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rotary_emb_fraction"):
        LLM(str(folder), runner="pooling")
