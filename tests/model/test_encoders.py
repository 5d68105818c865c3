"""Encoder models (--runner pooling) against sentence-transformers on the same folders: embeddings of every
pooling mode on tiny random BERT, XLM-RoBERTa and ModernBERT folders and on the real all-MiniLM-L6-v2, cross-encoder
scores against CrossEncoder.predict, and a small retrieval check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagellm import LLM
from pagellm.model.default_model import MINILM_INSTALL, build_encoder_checkpoint, minilm_path

st = pytest.importorskip("sentence_transformers")

TEXTS = [
    "Hello world",
    "",
    "The capital of France is Paris. " * 3,
    "héllo ünïcode 日本語 🙂 — naïve café",
    "paged attention " * 200,  # longer than the model's limit: truncated (truncate_prompt_tokens=-1)
]
COSINE_MIN = 0.99999


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_parity(folder: Path, texts: list[str] = TEXTS) -> np.ndarray:
    llm = LLM(str(folder), runner="pooling")
    ours = np.array([o.outputs.embedding for o in llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)])
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert ours.shape == ref.shape
    cos = cosines(ours, ref)
    assert cos.min() >= COSINE_MIN, cos
    return cos


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "modernbert"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "max", "mean_sqrt_len", "lasttoken"])
def test_pooling_modes_match_sentence_transformers(tmp_path: Path, family: str, pooling: str) -> None:
    folder = build_encoder_checkpoint(tmp_path / "m", family, pooling=pooling, normalize=pooling != "max",
                                      max_seq_length=48)
    assert_parity(folder)


def test_unnormalized_embeddings_keep_their_norm(tmp_path: Path) -> None:
    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="mean", normalize=False, max_seq_length=48)
    llm = LLM(str(folder), runner="pooling")
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS[:3], use_tqdm=False)])
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS[:3])
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.linalg.norm(ours, axis=-1), 1.0)


def test_over_long_input_is_refused_without_truncation(tmp_path: Path) -> None:
    folder = build_encoder_checkpoint(tmp_path / "m", "bert", pooling="mean", max_seq_length=48)
    llm = LLM(str(folder), runner="pooling")
    assert llm.llm_engine.max_model_len == 48  # sentence_bert_config.json's max_seq_length, as vLLM reads it
    with pytest.raises(ValueError, match="maximum context length is 48 tokens"):
        llm.embed(["paged attention " * 200], use_tqdm=False)
    out = llm.embed(["paged attention " * 200], truncate_prompt_tokens=10, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 10


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "modernbert"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_matches_sentence_transformers(tmp_path: Path, family: str, num_labels: int) -> None:
    extra = {"classifier_pooling": "mean"} if family == "modernbert" and num_labels == 1 else {}
    folder = build_encoder_checkpoint(tmp_path / "ce", family, num_labels=num_labels, **extra)
    query = "What is the capital of France?"
    docs = ["The capital of France is Paris.", "The quick brown fox jumps over the lazy dog.", "", "héllo 日本"]
    llm = LLM(str(folder), runner="pooling")
    assert llm.llm_engine.task == "classify"
    ce = st.CrossEncoder(str(folder), device="cpu")
    ref = np.asarray(ce.predict([(query, d) for d in docs]))
    if num_labels == 1:
        ours = np.array([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
        np.testing.assert_allclose(ours, ref.reshape(-1), atol=1e-4)
    else:
        probs = np.array([o.outputs.probs for o in llm.classify(docs, use_tqdm=False)])
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        ours = np.array([o.outputs.data for o in llm.encode([(query, d) for d in docs], pooling_task="score",
                                                            use_tqdm=False)])
        np.testing.assert_allclose(ours, ref, atol=1e-4)


@pytest.fixture(scope="module")
def minilm() -> Path:
    path = minilm_path()
    if path is None:
        pytest.skip(f"all-MiniLM-L6-v2 is not installed ({MINILM_INSTALL})")
    return path


def test_minilm_matches_sentence_transformers(minilm: Path) -> None:
    cos = assert_parity(minilm)
    print("all-MiniLM-L6-v2 cosine per text:", [f"{c:.9f}" for c in cos])


SOURCES = [
    ("The cat sat on the mat.", "A cat was sitting on a rug."),
    ("Paris is the capital of France.", "France's capital city is Paris."),
    ("I love eating pizza on Friday nights.", "On Friday evenings I enjoy having pizza."),
    ("The stock market fell sharply today.", "Shares dropped steeply in today's trading."),
    ("She plays the violin in an orchestra.", "She is a violinist in a symphony orchestra."),
    ("The train to Berlin leaves at noon.", "At 12 o'clock the Berlin train departs."),
    ("Water boils at one hundred degrees Celsius.", "At 100 °C water starts to boil."),
    ("He forgot his umbrella and got wet in the rain.", "Without his umbrella he was soaked by the rain."),
    ("The doctor prescribed antibiotics for the infection.", "The physician gave her antibiotics to treat it."),
    ("Our team won the football match yesterday.", "Yesterday we won the soccer game."),
    ("The laptop battery lasts ten hours.", "This notebook computer runs for ten hours on a charge."),
    ("Bees make honey from flower nectar.", "Honey is produced by bees using nectar from flowers."),
    ("The museum is closed on Mondays.", "On Monday the museum does not open."),
    ("He is learning to speak Japanese.", "He studies the Japanese language."),
    ("The recipe needs two eggs and a cup of flour.", "You need a cup of flour and a couple of eggs."),
    ("The server crashed because it ran out of memory.", "Running out of RAM made the server go down."),
    ("Mount Everest is the highest mountain on Earth.", "Earth's tallest peak is Everest."),
    ("The children built a sandcastle on the beach.", "At the seaside the kids made a castle of sand."),
    ("Please turn off the lights when you leave.", "Switch the lights off as you go out."),
    ("The library lends books for three weeks.", "You can borrow books from the library for 21 days."),
]


def test_minilm_retrieval_finds_each_paraphrase_source(minilm: Path) -> None:
    llm = LLM(str(minilm), runner="pooling")
    sources = np.array([o.outputs.embedding for o in llm.embed([s for s, _ in SOURCES], use_tqdm=False)])
    queries = np.array([o.outputs.embedding for o in llm.embed([p for _, p in SOURCES], use_tqdm=False)])
    nearest = (queries @ sources.T).argmax(axis=1)
    assert nearest.tolist() == list(range(len(SOURCES)))


def test_minilm_in_bfloat16_stays_close(minilm: Path) -> None:
    llm = LLM(str(minilm), runner="pooling", dtype="bfloat16")
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)])
    ref = st.SentenceTransformer(str(minilm), device="cpu").encode(TEXTS)
    cos = cosines(ours, ref)
    print("all-MiniLM-L6-v2 bfloat16 cosine per text:", [f"{c:.6f}" for c in cos])
    assert cos.min() >= 0.999, cos
