"""Decoder models on the pooling runner (--runner pooling --convert embed|classify): embeddings equal
transformers' hidden state at the pooled position (and sentence-transformers' encode where the folder has its
files), rerank scores equal the original Qwen3-Reranker's yes/no softmax and a Qwen3ForSequenceClassification's
sigmoid, on tiny random Qwen3 and Llama folders in float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm import LLM
from pagellm.model.default_model import build_checkpoint, write_sentence_transformers_files

TEXTS = ["Hello world", "The capital of France is Paris. " * 6, "a", "paged attention on two cores " * 3]
COSINE_MIN = 0.99999


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3") / "m", "qwen3", num_key_value_heads=2, head_dim=16)


def _hf_last_token(folder: Path, texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return np.array(rows)


def _embed(llm: LLM, texts: list[str]) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_last_token_embeddings_equal_transformers_hidden_state(tmp_path: Path, qwen3: Path, family: str) -> None:
    folder = qwen3 if family == "qwen3" else build_checkpoint(tmp_path / "m", "llama", num_key_value_heads=2)
    ours = _embed(LLM(str(folder), runner="pooling", convert="embed"), TEXTS)
    ref = _hf_last_token(folder, TEXTS)
    cos = (ours * ref).sum(-1)
    assert cos.min() >= COSINE_MIN, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)


def test_older_task_flag_embeds_the_same(qwen3: Path) -> None:
    a = _embed(LLM(str(qwen3), task="embed"), TEXTS[:2])
    b = _embed(LLM(str(qwen3), runner="pooling"), TEXTS[:2])  # a causal LM on the pooling runner embeds
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_sentence_transformers_files_pick_the_pooling(tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    folder = build_checkpoint(tmp_path / "m", "qwen3", num_key_value_heads=2, head_dim=16)
    write_sentence_transformers_files(folder, "mean", True, 64)
    ours = _embed(LLM(str(folder), runner="pooling", convert="embed"), TEXTS)
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=1)
    cos = (ours * ref).sum(-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= COSINE_MIN, cos


def _yes_no(folder: Path) -> tuple[str, str]:
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    words = [w for w in ("no", "yes", "the", "at", "in", "on") if w in vocab]
    assert len(words) >= 2, "the tiny tokenizer lacks the words the test scores with"
    return words[0], words[1]


def test_original_qwen3_reranker_scores_are_the_yes_no_softmax(qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    no, yes = _yes_no(qwen3)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    llm = LLM(str(qwen3), runner="pooling", hf_overrides=overrides)
    query, docs = "what is paged attention?", TEXTS
    ours = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tok, lm = AutoTokenizer.from_pretrained(qwen3), AutoModelForCausalLM.from_pretrained(qwen3).eval()
    ids = tok.convert_tokens_to_ids([no, yes])
    with torch.no_grad():
        ref = [float(torch.softmax(lm(**tok(query, doc, return_tensors="pt")).logits[0, -1, ids], -1)[1])
               for doc in docs]
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_sequence_classification_checkpoint_matches_transformers(tmp_path: Path, qwen3: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path / "cls"
    model = AutoModelForSequenceClassification.from_pretrained(qwen3, num_labels=1).eval()
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(qwen3).save_pretrained(folder)
    llm = LLM(str(folder))  # a *ForSequenceClassification decoder: the pooling runner by default
    pairs = [("what is paged attention?", doc) for doc in TEXTS]
    ours = [o.outputs.score for o in llm.score(pairs[0][0], [d for _, d in pairs], use_tqdm=False)]
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        ref = [float(torch.sigmoid(model(**tok(q, d, return_tensors="pt")).logits[0, 0])) for q, d in pairs]
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_convert_classify_without_a_head_says_how_to_serve_a_reranker(qwen3: Path) -> None:
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM(str(qwen3), runner="pooling", convert="classify")


def test_served_with_vllm_flags(qwen3: Path) -> None:
    """`pagellm serve M --convert embed` and the reranker's --hf-overrides, through httpx."""
    import json

    import httpx

    from tests.entrypoints.openai.server_utils import RemoteServer

    no, yes = _yes_no(qwen3)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    offline = LLM(str(qwen3), runner="pooling", hf_overrides=overrides)
    want = [o.outputs.score for o in offline.score("query", TEXTS[:2], use_tqdm=False)]
    srv = RemoteServer(qwen3, ["--runner", "pooling", "--hf-overrides", json.dumps(overrides)])
    try:
        r = httpx.post(srv.url + "/rerank", json={"query": "query", "documents": TEXTS[:2]}, timeout=30)
        assert r.status_code == 200, r.text
        got = {d["index"]: d["relevance_score"] for d in r.json()["results"]}
        np.testing.assert_allclose([got[0], got[1]], want, atol=1e-5)
    finally:
        srv.stop()
    srv = RemoteServer(qwen3, ["--convert", "embed", "--runner", "pooling"])
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=30)
        assert r.status_code == 200, r.text
        got_emb = np.array([d["embedding"] for d in r.json()["data"]])
        np.testing.assert_allclose(got_emb, _hf_last_token(qwen3, TEXTS[:2]), atol=1e-5)
    finally:
        srv.stop()
