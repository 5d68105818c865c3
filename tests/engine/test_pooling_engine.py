"""The pooling engine: runner choice, batching across requests, a failed batch isolated to its bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagellm import LLM
from pagellm.config import EngineArgs
from pagellm.engine.pooling_engine import PoolingEngine
from pagellm.engine.runner_choice import pooling_task
from pagellm.model.default_model import build_encoder_checkpoint


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder_checkpoint(tmp_path_factory.mktemp("bert") / "m", "bert", pooling="mean",
                                    max_seq_length=48)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder_checkpoint(tmp_path_factory.mktemp("ce") / "m", "bert", num_labels=1)


def test_runner_choice(bert: Path, cross_encoder: Path, llama_path: Path) -> None:
    def task(**kw: object) -> str | None:
        return pooling_task(EngineArgs(**kw))  # type: ignore[arg-type]

    assert task(model=str(bert)) == "embed"  # --runner auto: pooling for an encoder's folder
    assert task(model=str(cross_encoder)) == "classify"
    assert task(model=str(cross_encoder), convert="embed") == "embed"
    assert task(model=str(bert), task="embed") == "embed"
    assert task(model=str(cross_encoder), task="score") == "classify"
    assert task(model=str(llama_path)) is None
    with pytest.raises(ValueError, match="--runner pooling"):
        task(model=str(bert), runner="generate")
    assert task(model=str(llama_path), runner="pooling") == "embed"  # a decoder embeds (last token)
    assert task(model=str(llama_path), runner="pooling", hf_overrides={"classifier_from_token": ["a", "b"]}) \
        == "classify"
    with pytest.raises(ValueError, match="--runner pooling runs"):
        task(runner="pooling")  # the default model: a GGUF file
    with pytest.raises(ValueError, match="classification head"):
        task(model=str(bert), convert="classify")
    with pytest.raises(ValueError, match="contradicts"):
        task(model=str(bert), task="embed", runner="generate")


def test_requests_are_batched_by_tokens(bert: Path) -> None:
    engine = PoolingEngine(EngineArgs(model=str(bert), max_num_batched_tokens=64))
    for i in range(20):
        engine.add_request(str(i), "the quick brown fox")  # 6 tokens each
    batches = []
    while engine.has_unfinished_requests():
        batches.append(len(engine.step()))
    assert sum(batches) == 20 and max(batches) == 10


def test_a_failing_input_fails_alone(bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = PoolingEngine(EngineArgs(model=str(bert)))
    real_run = engine.runner.run
    poison = engine.tokenize("poison")[0]

    def run(batch, task):  # type: ignore[no-untyped-def]
        if any(item.token_ids == poison for item in batch):
            raise RuntimeError("boom")
        return real_run(batch, task)

    monkeypatch.setattr(engine.runner, "run", run)
    for rid, text in (("a", "hello"), ("b", "poison"), ("c", "world")):
        engine.add_request(rid, text)
    results = dict(engine.step())
    assert isinstance(results["b"], RuntimeError)
    assert len(results["a"].outputs.data) == len(results["c"].outputs.data) == 64  # type: ignore[union-attr]
    assert not engine.has_unfinished_requests()


def test_llm_refuses_the_other_runners_methods(bert: Path, llama_path: Path) -> None:
    pooling = LLM(str(bert))
    with pytest.raises(ValueError, match="runner='pooling'"):
        pooling.generate("hello")
    generative = LLM(str(llama_path), num_kv_blocks=16)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generative.embed("hello")


def test_token_id_inputs_and_bi_encoder_scores(bert: Path) -> None:
    llm = LLM(str(bert), runner="pooling")
    ids = llm.get_tokenizer()("hello world")["input_ids"]
    by_text, by_ids = llm.embed(["hello world", {"prompt_token_ids": ids}], use_tqdm=False)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs.embedding == pytest.approx(by_ids.outputs.embedding, abs=1e-6)
    (same,) = llm.score("hello world", ["hello world"], use_tqdm=False)
    assert same.outputs.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        llm.embed([[10**6]], use_tqdm=False)


def test_inputs_of_like_lengths_are_padded_together() -> None:
    from pagellm.worker.pooling_runner import length_groups

    groups = length_groups([100, 3, 5, 120, 40, 4])
    assert groups == [[1, 5, 2], [4], [0, 3]]
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_mixed_lengths_in_one_step_keep_their_order(bert: Path) -> None:
    llm = LLM(str(bert), runner="pooling")
    texts = ["paged attention " * 12, "hi", "the quick brown fox jumps", "a"]
    together = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    alone = [llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in texts]
    for a, b in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-5)
