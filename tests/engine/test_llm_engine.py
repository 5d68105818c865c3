"""The engine end to end on a tiny Llama: preemption, stops, aborts, bad input."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from pagellm import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.helpers import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=256, num_kv_blocks=64, block_size=8)


@pytest.mark.slow
def test_preemption_gives_the_tokens_of_an_unconstrained_run(llama_path):
    prompts = random_prompts([20, 33, 9, 50, 27, 12], vocab=500, seed=3)
    free_run = LLM(str(llama_path), max_model_len=128, num_kv_blocks=256, block_size=4)
    expected = [o.outputs[0].token_ids for o in free_run.generate(prompts, GREEDY, use_tqdm=False)]
    # 30 blocks of 4 = 120 slots: the six requests need ~360 at peak, so some get preempted.
    tight = LLM(str(llama_path), max_model_len=120, num_kv_blocks=30, block_size=4)
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(tight)


def test_stop_token_ids_end_with_stop_and_the_token_as_reason(llm):
    (free,) = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    tokens = free.outputs[0].token_ids
    stop_tok = tokens[5]
    first = tokens.index(stop_tok)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.token_ids == tokens[: first + 1]
    assert_all_blocks_free(llm)


def test_stop_strings_cut_the_text_and_report_the_string(llm):
    tok = llm.get_tokenizer()
    (free,) = llm.generate(["Hello, world"], GREEDY, use_tqdm=False)
    text = free.outputs[0].text
    assert text == tok.decode(free.outputs[0].token_ids, skip_special_tokens=True)
    stop = text[6:9]
    idx = text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never-there"])
    (out,) = llm.generate(["Hello, world"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:idx]
    with_stop = params.clone(include_stop_str_in_output=True)
    (out2,) = llm.generate(["Hello, world"], with_stop, use_tqdm=False)
    assert out2.outputs[0].text == text[: idx + len(stop)]
    assert_all_blocks_free(llm)


def test_eos_ends_generation_unless_ignored(llama_path):
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=64)
    eos = llm.get_tokenizer().eos_token_id
    # Make EOS the only choice: a huge logit bias on it.
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    (out,) = llm.generate(["Hi"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [eos]
    assert out.outputs[0].stop_reason is None and out.outputs[0].text == ""
    (ignored,) = llm.generate(["Hi"], params.clone(ignore_eos=True), use_tqdm=False)
    assert ignored.outputs[0].finish_reason == "length" and len(ignored.outputs[0].token_ids) == 10
    (min_tok,) = llm.generate(["Hi"], params.clone(min_tokens=3), use_tqdm=False)
    assert len(min_tok.outputs[0].token_ids) == 4 and min_tok.outputs[0].token_ids[-1] == eos
    assert_all_blocks_free(llm)


def test_generation_stops_at_max_model_len(llama_path):
    llm = LLM(str(llama_path), max_model_len=32, num_kv_blocks=16)
    (out,) = llm.generate([list(range(10, 30))], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12


def test_abort_frees_blocks_in_every_state_and_engine_keeps_serving(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=64,
                                  max_num_batched_tokens=16, max_num_seqs=16, block_size=4))
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("running", list(range(5, 10)), p)
    engine.add_request("chunking", list(range(5, 105)), p)
    engine.add_request("waiting", list(range(5, 50)), p)
    engine.step()
    engine.step()
    states = {s.request.request_id: s.status.name for s in engine.scheduler.running}
    assert states.get("running") == "RUNNING" and states.get("chunking") == "RUNNING"
    assert engine.scheduler.waiting and engine.scheduler.waiting[0].request.request_id == "waiting"
    engine.abort_request(["chunking", "waiting", "running", "unknown-id"])
    engine.kv_cache_manager.assert_consistent()
    assert engine.kv_cache_manager.num_free_blocks == 64 and not engine.has_unfinished_requests()
    engine.add_request("next", [5, 6, 7], p)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
    assert [o.request_id for o in outs] == ["next"] * 30  # one output per step, streaming-style


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda: ([list(range(4, 304))], None), "300 tokens long but max_model_len is 256"),
        (lambda: (["x"], dict(max_tokens=0)), "max_tokens must be an integer >= 1"),
        (lambda: (["x"], dict(temperature=-1)), "temperature must be a number in"),
        (lambda: (["x"], dict(top_p=0)), r"top_p must be a number in \(0, 1\]"),
        (lambda: (["x"], dict(n=0)), "n must be an integer >= 1"),
        (lambda: ([""], None), "prompt is empty"),
        (lambda: ([[1, 2, 99999]], None), r"token ids must be integers in \[0, "),
        (lambda: ([3.5], None), "a prompt must be a string"),
        (lambda: (["x"], dict(logit_bias={10**6: 1.0})), r"logit_bias has token ids outside this model's vocab"),
        (lambda: (["x"], dict(min_tokens=2, stop_token_ids=list(range(2000)))),
         "cover every token of the vocabulary"),
    ],
)
def test_bad_input_raises_a_clear_error_and_the_engine_serves_the_next(llm, make_bad, match):
    prompts, fields = make_bad()
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", *prompts], SamplingParams(**fields) if fields else GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)  # the good prompt of the batch was not left queued
    (ok,) = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 40
    assert_all_blocks_free(llm)


def test_duplicate_request_id_is_refused(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16))
    engine.add_request("a", "hi")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "hi")
    engine.abort_request("a")
    assert engine.kv_cache_manager.num_free_blocks == 16


def test_text_decoded_once_at_the_end_equals_the_streamed_text(llm):
    """LLM.generate's requests are read only when finished, so their text is decoded once, at the end;
    it must be what streaming token by token gives, for stops by length, by token (kept or not), with
    special tokens shown or skipped."""
    tok = llm.get_tokenizer()
    prompts = ["Hello, world", "The capital of France is", "1 2 3"]
    (probe,) = llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    stop_tok = probe.outputs[0].token_ids[7]
    cases = [
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True, skip_special_tokens=False),
    ]
    engine = llm.llm_engine
    assert engine.output_processor.decode_at_end_matches_stream  # this tokenizer: decoded once at the end
    for i, params in enumerate(cases):
        finals = llm.generate(prompts, params, use_tqdm=False)  # FINAL_ONLY
        for j, prompt in enumerate(prompts):
            engine.add_request(f"stream-{i}-{j}", prompt, params)  # CUMULATIVE: detokenized every step
        streamed = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed[out.request_id] = out.outputs[0].text
        for j, final in enumerate(finals):
            c = final.outputs[0]
            assert c.text == streamed[f"stream-{i}-{j}"]
            assert c.text  # something was decoded
            if c.stop_reason is None:
                assert c.text == tok.decode(c.token_ids, skip_special_tokens=params.skip_special_tokens)
    assert_all_blocks_free(llm)


def test_tokenizers_that_clean_up_spaces_are_decoded_as_they_stream(llama_path, tmp_path):
    """With clean_up_tokenization_spaces, the text of a window depends on where it starts ("do " + "n't"
    streams as "do 't" but decodes at once as "don't"), so such requests are decoded every step."""
    folder = tmp_path / "cleanup"
    shutil.copytree(llama_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    llm = LLM(str(folder), max_model_len=128, num_kv_blocks=32, block_size=8)
    engine = llm.llm_engine
    assert engine.tokenizer.clean_up_tokenization_spaces and not engine.output_processor.decode_at_end_matches_stream
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    (final,) = llm.generate(["Hello, world"], params, use_tqdm=False)
    engine.add_request("streamed", "Hello, world", params)
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed = out.outputs[0].text
    assert final.outputs[0].text == streamed


def test_the_model_length_limit_is_lowered_to_what_the_kv_cache_holds(llama_path, caplog):
    """Without --max-model-len, the model's own limit (2048 here) is served as far as the KV cache
    holds it, with a log line; an asked length that does not fit stays an error."""
    with caplog.at_level(logging.INFO, logger="pagellm.engine.llm_engine"):
        llm = LLM(str(llama_path), num_kv_blocks=8, block_size=16)
    assert llm.llm_engine.max_model_len == 128
    assert any("does not fit the KV cache of 128 tokens" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="one sequence of max_model_len=256 needs 16 blocks"):
        LLM(str(llama_path), num_kv_blocks=8, block_size=16, max_model_len=256)
