"""The offline LLM API as a vLLM user drives it."""

from __future__ import annotations

import logging

import pytest

from pagellm import LLM, CompletionOutput, RequestOutput, SamplingParams
from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path
from tests.helpers import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=128, num_kv_blocks=64)


@pytest.mark.slow
@pytest.mark.skipif(embedded_gguf_path() is None,
                    reason=f"the embedded model is not installed: {DEFAULT_MODEL_INSTALL}")
def test_the_default_model_is_smollm2_and_answers_in_english():
    llm = LLM()  # the embedded default, every setting at its default
    engine = llm.llm_engine
    assert engine.model_path == embedded_gguf_path()
    assert engine.max_model_len == 8192 and engine.block_size == 16
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_without_the_model_wheel_the_tiny_model_is_the_default(monkeypatch, caplog):
    from pagellm.model import default_model

    monkeypatch.setattr(default_model, "embedded_gguf_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger="pagellm.model.default_model"):
        llm = LLM(max_model_len=128)
    assert llm.llm_engine.model_path.name == "pagellm-tiny-llama-v1"
    assert any(DEFAULT_MODEL_INSTALL in r.getMessage() for r in caplog.records)
    (out,) = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text
    assert_all_blocks_free(llm)


def test_prompt_forms_mixed_and_outputs_in_input_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello, world")
    prompts = ["Hello, world", ids, {"prompt": "Hello, world"}, {"prompt_token_ids": ids}, "The quick brown fox"]
    params = [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY.clone(max_tokens=3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    first = outs[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == first for o in outs[:4])
    assert outs[0].prompt == "Hello, world" and outs[1].prompt is None
    assert outs[0].prompt_token_ids == ids
    assert len(outs[4].outputs[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_request_output_fields_and_metrics(llm):
    (out,) = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput)
    assert c.index == 0 and c.finish_reason == "length" and c.stop_reason is None
    assert c.logprobs is None and out.prompt_logprobs is None
    assert c.cumulative_logprob is None  # as in vLLM: reported where logprobs are asked for
    (scored,) = llm.generate(["Hello"], GREEDY.clone(logprobs=0), use_tqdm=False)
    assert scored.outputs[0].token_ids == c.token_ids
    chosen = [entry[t].logprob for t, entry in zip(c.token_ids, scored.outputs[0].logprobs)]
    assert scored.outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4) and sum(chosen) < 0
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token >= 0 and m.num_preemptions == 0


def test_chat_uses_the_chat_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    (a,) = llm.chat(conv, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert "<|assistant|>" in ids
    (b,) = llm.generate([{"prompt": ids}], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    two = llm.chat([conv, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == a.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages must be a list"):
        llm.chat([["not a message"]], GREEDY, use_tqdm=False)
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}" \
             "{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="the chat template refused these messages: the first message must be"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template=strict)
    with pytest.raises(ValueError, match=r"the chat template is not valid Jinja \(line 1\)"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template="{% for %}")
    assert_all_blocks_free(llm)


def test_chat_continues_the_final_message_and_takes_template_kwargs(llm):
    start = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Once upon"}]
    (out,) = llm.chat(start, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("Once upon")  # left open for the reply
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(start, GREEDY, use_tqdm=False, continue_final_message=True)
    shout = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if loud %}!{% endif %}"
    (loud,) = llm.chat(start, GREEDY, use_tqdm=False, chat_template=shout, chat_template_kwargs={"loud": True})
    assert loud.prompt.endswith("Once upon!")


def test_progress_bar_is_shown_with_tqdm(llm, capsys):
    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_argument_errors_are_clear(llm, llama_path):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine argument.*max_num_seq"):
        LLM(str(llama_path), max_num_seq=4)
    with pytest.raises(ValueError, match=r"block_size \(--block-size\) must be an integer in \[1, 256\]"):
        LLM(str(llama_path), block_size=512)
    assert_all_blocks_free(llm)


def test_prompts_and_params_of_the_wrong_type_are_named(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a"], [{"max_tokens": 3}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be one prompt .* or a list of them, not NoneType"):
        llm.generate(None, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_special_tokens must be True or False"):
        llm.generate(["a"], SamplingParams(skip_special_tokens="no"), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_numpy_token_ids_are_taken_like_ints(llm):
    import numpy as np

    ids = [5, 6, 7, 8]
    (a,) = llm.generate([ids], GREEDY, use_tqdm=False)
    (b,) = llm.generate([list(np.array(ids, dtype=np.int64))], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.prompt_token_ids == ids and all(type(t) is int for t in b.prompt_token_ids)
