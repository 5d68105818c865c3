"""Embedding clients against the pooling server (--runner pooling) on a tiny BERT folder: LangChain's
OpenAIEmbeddings, LlamaIndex's OpenAILikeEmbedding and LiteLLM's `embedding` (`hosted_vllm/` and `openai/`),
compared with offline LLM.embed; a Cohere-style rerank request through httpx on a tiny cross-encoder."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from pagellm import LLM
from pagellm.model.default_model import build_encoder_checkpoint
from tests.entrypoints.openai.server_utils import RemoteServer

pytestmark = pytest.mark.peers

KEY = "embed-key"
TEXTS = ["The capital of France is Paris.", "Hello world", "héllo 日本語"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory):
    folder = build_encoder_checkpoint(tmp_path_factory.mktemp("embed") / "bert", "bert", pooling="mean")
    srv = RemoteServer(folder, ["--served-model-name", "tiny-embed"], api_key=KEY)
    offline = np.array([o.outputs.embedding for o in LLM(str(folder), runner="pooling").embed(TEXTS, use_tqdm=False)])
    yield srv, offline
    srv.stop()


def test_langchain_openai_embeddings(embedder) -> None:
    from langchain_openai import OpenAIEmbeddings

    srv, offline = embedder
    emb = OpenAIEmbeddings(model="tiny-embed", base_url=srv.url + "/v1", api_key=KEY,
                           check_embedding_ctx_length=False)
    np.testing.assert_allclose(emb.embed_documents(TEXTS), offline, atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), offline[0], atol=1e-6)


def test_llamaindex_openai_like_embedding(embedder) -> None:
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    srv, offline = embedder
    emb = OpenAILikeEmbedding(model_name="tiny-embed", api_base=srv.url + "/v1", api_key=KEY, embed_batch_size=2)
    one = np.array(emb.get_text_embedding(TEXTS[1]))
    batch = np.array(emb.get_text_embedding_batch(TEXTS))  # two requests: embed_batch_size=2
    query = np.array(emb.get_query_embedding(TEXTS[0]))
    assert batch.shape == offline.shape
    assert cosines(batch, offline).min() >= 0.9999
    assert cosines(one, offline[1]) >= 0.9999
    assert cosines(query, offline[0]) >= 0.9999


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_embedding(embedder, provider: str) -> None:
    import litellm

    srv, offline = embedder
    r = litellm.embedding(model=f"{provider}/tiny-embed", input=TEXTS, api_base=srv.url + "/v1", api_key=KEY)
    np.testing.assert_allclose([d["embedding"] for d in r.data], offline, atol=1e-6)


def test_cohere_style_rerank(tmp_path: Path) -> None:
    folder = build_encoder_checkpoint(tmp_path / "ce", "bert", num_labels=1)
    docs = ["The quick brown fox.", "The capital of France is Paris.", "Hello world", "Once upon a time"]
    query = "What is the capital of France?"
    offline = [o.outputs.score for o in LLM(str(folder), runner="pooling").score(query, docs, use_tqdm=False)]
    srv = RemoteServer(folder, ["--task", "score"])
    try:
        r = httpx.post(srv.url + "/v2/rerank", json={"model": str(folder), "query": query, "documents": docs,
                                                     "top_n": 3, "return_documents": False})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        best = sorted(range(len(docs)), key=lambda i: -offline[i])[:3]
        assert [x["index"] for x in results] == best
        assert [x["relevance_score"] for x in results] == pytest.approx([offline[i] for i in best], abs=1e-6)
    finally:
        srv.stop()
