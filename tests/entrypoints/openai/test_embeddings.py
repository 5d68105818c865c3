"""The pooling server (--runner pooling) through the real openai SDK and httpx: /v1/embeddings (strings,
token ids, float and base64, dimensions, usage) against offline LLM.embed; /score and the rerank shapes on
a cross-encoder against LLM.score; each runner's 400 naming the other."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from pagellm import LLM, EngineArgs, LLMEngine
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.model.default_model import build_encoder_checkpoint
from tests.entrypoints.openai.server_utils import RemoteServer

openai = pytest.importorskip("openai")

TEXTS = ["Hello world", "The capital of France is Paris.", "", "héllo 日本語 🙂"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder_checkpoint(tmp_path_factory.mktemp("embed") / "bert", "bert", pooling="mean",
                                    max_seq_length=48)


@pytest.fixture(scope="module")
def server(bert: Path):
    srv = RemoteServer(bert, ["--served-model-name", "tiny-bert"])  # --runner auto: pooling for an encoder
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(bert: Path) -> np.ndarray:
    llm = LLM(str(bert), runner="pooling")
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_sdk_embeddings_equal_offline_embed(client, offline: np.ndarray, encoding_format: str) -> None:
    res = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format=encoding_format, user="u1")
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    # (asked for base64, the SDK hands the strings over as sent: little-endian float32)
    got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if encoding_format == "base64"
                    else d.embedding for d in res.data])
    np.testing.assert_allclose(got, offline, atol=1e-6)
    assert res.usage.prompt_tokens == res.usage.total_tokens > len(TEXTS)
    assert res.model == "tiny-bert"


def test_sdk_default_encoding_is_base64_decoded(client, offline: np.ndarray) -> None:
    res = client.embeddings.create(model="tiny-bert", input=TEXTS)  # the SDK asks for base64 and decodes it
    np.testing.assert_allclose([d.embedding for d in res.data], offline, atol=1e-6)


def test_one_string_and_token_ids(client, server: RemoteServer, offline: np.ndarray) -> None:
    one = client.embeddings.create(model="tiny-bert", input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, offline[1], atol=1e-6)
    ids = LLM(str(server_model(server)), runner="pooling").get_tokenizer()(TEXTS[:2])["input_ids"]
    by_ids = client.embeddings.create(model="tiny-bert", input=ids)
    np.testing.assert_allclose([d.embedding for d in by_ids.data], offline[:2], atol=1e-6)
    single = client.embeddings.create(model="tiny-bert", input=ids[1])
    np.testing.assert_allclose(single.data[0].embedding, offline[1], atol=1e-6)
    assert single.usage.prompt_tokens == len(ids[1])


def server_model(server: RemoteServer) -> Path:
    return Path(httpx.get(server.url + "/v1/models").json()["data"][0]["root"])


def test_bad_requests_are_400s(client, server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model="tiny-bert", input="hi", dimensions=16)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 48"):
        client.embeddings.create(model="tiny-bert", input="paged attention " * 100)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "paged attention " * 100,
                                                        "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 48
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    r = httpx.post(server.url + "/v1/embeddings", json={"input": []})
    assert r.status_code == 400
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(server.url + path, json={"model": "tiny-bert", "prompt": "hi",
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"], r.text


def test_bi_encoder_score_is_cosine(server: RemoteServer) -> None:
    r = httpx.post(server.url + "/v1/score", json={"text_1": "Hello world", "text_2": ["Hello world", "Paris"]})
    scores = [d["score"] for d in r.json()["data"]]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < scores[0]


def test_generative_server_names_runner_pooling(llama_path: Path) -> None:
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=16, device="cpu"))
    with TestClient(build_app(engine, "tiny")) as http:
        for path in ("/v1/embeddings", "/v1/score", "/v2/rerank"):
            r = http.post(path, json={"input": "hi"})
            assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):
    folder = build_encoder_checkpoint(tmp_path_factory.mktemp("rerank") / "ce", "bert", num_labels=1)
    srv = RemoteServer(folder, ["--runner", "pooling", "--convert", "classify"])
    yield folder, srv
    srv.stop()


def test_rerank_and_score_equal_offline_score(reranker) -> None:
    folder, srv = reranker
    query = "What is the capital of France?"
    docs = ["The quick brown fox.", "The capital of France is Paris.", "Hello world"]
    offline = [o.outputs.score for o in LLM(str(folder), runner="pooling").score(query, docs, use_tqdm=False)]
    r = httpx.post(srv.url + "/score", json={"text_1": query, "text_2": docs})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(offline, abs=1e-6)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": query, "documents": docs, "top_n": 2, "return_documents": path != "/v2/rerank"}
        res = httpx.post(srv.url + path, json=body).json()["results"]
        best = sorted(range(3), key=lambda i: -offline[i])[:2]
        assert [x["index"] for x in res] == best
        assert [x["relevance_score"] for x in res] == pytest.approx([offline[i] for i in best], abs=1e-6)
        assert ("document" in res[0]) == (path != "/v2/rerank")
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 200  # a cross-encoder embeds too (its encoder's pooled output)
    cut = [o.outputs.score for o in LLM(str(folder), runner="pooling").score(query, ["The capital"], use_tqdm=False)]
    res = httpx.post(srv.url + "/v2/rerank", json={"query": query, "documents": [docs[1]],
                                                   "max_tokens_per_doc": 2}).json()["results"]
    assert res[0]["relevance_score"] == pytest.approx(cut[0], abs=1e-6)


def test_concurrent_requests_each_get_their_own_embeddings(server: RemoteServer, offline: np.ndarray) -> None:
    import asyncio

    async def main() -> list[list[list[float]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def one(i: int) -> list[list[float]]:
                texts = [TEXTS[i % 4], TEXTS[(i + 1) % 4]]
                r = await http.post("/v1/embeddings", json={"input": texts})
                assert r.status_code == 200, r.text
                return [d["embedding"] for d in r.json()["data"]]
            return await asyncio.gather(*(one(i) for i in range(24)))

    for i, got in enumerate(asyncio.run(main())):
        np.testing.assert_allclose(got, offline[[i % 4, (i + 1) % 4]], atol=1e-6)


def test_metrics_count_pooling_requests(server: RemoteServer) -> None:
    before = server.metric("pagellm_prompt_tokens_total")
    r = httpx.post(server.url + "/v1/embeddings", json={"input": ["Hello world", "Paris"]})
    tokens = r.json()["usage"]["prompt_tokens"]
    assert server.metric("pagellm_prompt_tokens_total") == before + tokens
    assert server.metric("pagellm_pooling_requests_total", 'kind="embedding"') >= 1
    assert server.metric("vllm:prompt_tokens_total") == before + tokens
    assert server.metric("pagellm_pooling_batch_tokens_count") >= 1
