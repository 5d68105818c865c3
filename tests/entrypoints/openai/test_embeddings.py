"""The pooling server (--runner pooling) through the real openai SDK and httpx: /v1/embeddings (strings,
token ids, float and base64, dimensions, usage) against offline LLM.embed; /score and the rerank shapes on
a cross-encoder against LLM.score; each runner's 400 naming the other; a retrieval check on the real
all-MiniLM-L6-v2 (each of 50 paraphrases finds its source sentence)."""

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


# Fifty sentences on distinct topics, each with a paraphrase sharing few of its words.
RETRIEVAL_PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on a rug."),
    ("Paris is the capital of France.", "France's seat of government is the city of Paris."),
    ("I love eating pizza on Friday nights.", "On Friday evenings I enjoy having pizza."),
    ("The stock market fell sharply today.", "Shares dropped steeply in today's trading."),
    ("She plays the violin in an orchestra.", "She is a violinist in a symphony orchestra."),
    ("The train to Berlin leaves at noon.", "At 12 o'clock the Berlin train departs."),
    ("Water boils at one hundred degrees Celsius.", "At 100 °C water starts to boil."),
    ("He forgot his umbrella and got wet in the rain.", "Without his umbrella he was soaked by the shower."),
    ("The doctor prescribed antibiotics for the infection.", "The physician gave her medicine to treat the infection."),
    ("Our team won the football match yesterday.", "Yesterday we beat the other side at soccer."),
    ("The laptop battery lasts ten hours.", "This notebook computer runs for ten hours on a charge."),
    ("Bees make honey from flower nectar.", "Honey is produced by bees using nectar from blossoms."),
    ("The museum is closed on Mondays.", "On Monday the gallery does not open its doors."),
    ("He is learning to speak Japanese.", "He studies the Japanese language."),
    ("The recipe needs two eggs and a cup of flour.", "You need a cup of flour and a couple of eggs to bake it."),
    ("The server crashed because it ran out of memory.", "Running out of RAM made the machine go down."),
    ("Mount Everest is the highest mountain on Earth.", "Earth's tallest peak is Everest."),
    ("The children built a sandcastle on the beach.", "At the seaside the kids made a castle of sand."),
    ("Please turn off the lights when you leave.", "Switch the lamps off as you go out."),
    ("The library lends books for three weeks.", "You can borrow a novel from the library for 21 days."),
    ("My grandmother knits warm woollen scarves every winter.",
     "Each winter Grandma makes cosy wool scarves with her needles."),
    ("The volcano erupted and covered the village in ash.", "Ash buried the town after the eruption of the mountain."),
    ("Electric cars need charging stations along highways.",
     "Battery-powered vehicles rely on chargers beside motorways."),
    ("The baby finally fell asleep after midnight.", "It was past twelve at night when the infant dozed off."),
    ("Our flight was delayed by three hours because of fog.",
     "Thick mist held our plane on the ground for three hours."),
    ("The dentist found a cavity in my back tooth.", "A hole in one of my molars was spotted at the dental check-up."),
    ("Tomatoes grow best in full sunshine.", "Tomato plants thrive when they get plenty of sun."),
    ("The judge sentenced the thief to two years in prison.", "The court sent the burglar to jail for two years."),
    ("Whales communicate with long underwater songs.",
     "Large marine mammals talk to each other by singing beneath the sea."),
    ("He repaired the leaking kitchen tap with a new washer.",
     "A fresh rubber seal fixed the dripping faucet in the kitchen."),
    ("The company hired fifty new engineers this year.",
     "Fifty developers joined the firm's payroll in the past twelve months."),
    ("She ran a marathon in under four hours.", "Her time for the 42-kilometre race was below four hours."),
    ("The ice on the lake is too thin to walk on.",
     "It is unsafe to step onto the frozen pond because the ice is fragile."),
    ("Chess players must think several moves ahead.", "In chess you have to plan your next few turns in advance."),
    ("The old bridge was closed for repairs.", "Traffic cannot cross the ancient bridge while it is being mended."),
    ("Coffee keeps me awake when I study late.", "Drinking espresso stops me dozing off during late-night revision."),
    ("The parliament passed a new tax law.", "Legislators voted through fresh rules on taxation."),
    ("A rainbow appeared after the storm.", "Once the thunderstorm ended, colourful arcs showed in the sky."),
    ("The puppy chewed my favourite shoes.", "My young dog gnawed on the pair of shoes I like best."),
    ("Solar panels turn sunlight into electricity.", "Photovoltaic cells convert the sun's rays into power."),
    ("The restaurant serves vegetarian dishes only.", "No meat is on the menu at that eatery."),
    ("Astronauts live on the space station for months.", "Crews stay aboard the orbiting laboratory for long periods."),
    ("He lost his wallet on the bus.", "His purse went missing while he was riding public transport."),
    ("The printer is out of ink again.", "Once more the printing machine has no cartridge left."),
    ("Vaccines train the immune system to fight viruses.",
     "Immunisation teaches the body's defences to resist viral disease."),
    ("The orchestra tuned their instruments before the concert.",
     "Before the performance the musicians adjusted the pitch of their instruments."),
    ("Farmers harvest wheat at the end of summer.", "Late in the summer growers gather the grain crop."),
    ("The password must contain at least twelve characters.",
     "Your login secret needs a minimum length of twelve symbols."),
    ("The river flooded the fields after heavy rain.",
     "Torrential downpours made the stream overflow onto the farmland."),
    ("Penguins cannot fly but they swim very well.", "These flightless Antarctic birds are excellent swimmers."),
]


def test_minilm_retrieval_through_the_server() -> None:
    from pagellm.model.default_model import MINILM_INSTALL, minilm_path

    folder = minilm_path()
    if folder is None:
        pytest.skip(f"all-MiniLM-L6-v2 is not installed ({MINILM_INSTALL})")
    assert len(RETRIEVAL_PAIRS) == 50 and len({s for s, _ in RETRIEVAL_PAIRS}) == 50
    srv = RemoteServer(folder, ["--served-model-name", "all-MiniLM-L6-v2"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")

        def embed(texts: list[str]) -> np.ndarray:
            return np.array([d.embedding for d in client.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data])

        sources = embed([s for s, _ in RETRIEVAL_PAIRS])
        queries = embed([p for _, p in RETRIEVAL_PAIRS])
    finally:
        srv.stop()
    np.testing.assert_allclose(np.linalg.norm(sources, axis=1), 1.0, atol=1e-5)  # the folder's Normalize module
    nearest = (queries @ sources.T).argmax(axis=1)
    misses = [(RETRIEVAL_PAIRS[i][1], RETRIEVAL_PAIRS[j][0]) for i, j in enumerate(nearest) if i != j]
    assert not misses, misses
