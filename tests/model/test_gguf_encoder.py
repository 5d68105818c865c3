"""GGUF embedding models as llama.cpp stores them (bert, nomic-bert): a tiny random folder written as GGUF with
gguf's writer (llama.cpp's names, metadata and phantom-space vocabulary) embeds as the folder does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagellm import LLM
from pagellm.model.default_model import build_encoder_checkpoint
from tests.model.gguf_writer import write_encoder_gguf

TEXTS = ["Hello world", "The capital of France is Paris. " * 3, "", "Héllo Wörld unknownword"]


def _embed(model: Path) -> np.ndarray:
    llm = LLM(str(model), runner="pooling")
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


@pytest.mark.parametrize("family", ["bert", "nomic_bert"])
def test_gguf_embeddings_equal_the_folders(tmp_path: Path, family: str) -> None:
    folder = build_encoder_checkpoint(tmp_path / "m", family, pooling="mean")
    gguf_path = write_encoder_gguf(folder, tmp_path / "m.gguf")
    ours, ref = _embed(gguf_path), _embed(folder)
    assert ((ours * ref).sum(-1)).min() >= 0.99999


def test_gguf_tokenizer_is_rebuilt_from_the_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="cls")
    gguf_path = write_encoder_gguf(folder, tmp_path / "m.gguf", pooling="cls")
    llm = LLM(str(gguf_path), runner="pooling")
    tok = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert llm.llm_engine.tokenize(text)[0] == tok(text)["input_ids"]


def test_quantized_gguf_embeds_close_to_the_folder(tmp_path: Path) -> None:
    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="mean")
    ours = _embed(write_encoder_gguf(folder, tmp_path / "m.gguf", qtype="Q8_0"))
    assert ((ours * _embed(folder)).sum(-1)).min() >= 0.99


def test_gguf_embedder_is_served(tmp_path: Path) -> None:
    import httpx

    from tests.entrypoints.openai.server_utils import RemoteServer

    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="mean")
    gguf_path = write_encoder_gguf(folder, tmp_path / "m.gguf")
    srv = RemoteServer(gguf_path, [])  # --runner auto: pooling for a bert GGUF file
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=30)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        np.testing.assert_allclose(got, _embed(folder)[:2], atol=1e-5)
    finally:
        srv.stop()
