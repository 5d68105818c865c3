"""Constrained decoding through the offline LLM on a random-weight model: the grammar alone decides
what is valid, so every output must match its constraint."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from tests.structured.schemas import CHOICES, REGEXES, SCHEMAS


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=1024, num_kv_blocks=512)


def constrained(seed: int = 0, temperature: float = 1.0, max_tokens: int = 300, **so) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_validates(llm, temperature):
    names = list(SCHEMAS)
    params = [constrained(i, temperature, json=SCHEMAS[n]) for i, n in enumerate(names)]
    outs = llm.generate(["Answer in JSON:"] * len(names), params, use_tqdm=False)
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])


def test_schema_as_text_and_json_object(llm):
    out = llm.generate("x", constrained(json=json.dumps(SCHEMAS["flat"])), use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMAS["flat"])
    out = llm.generate("x", constrained(json_object=True, max_tokens=400), use_tqdm=False)[0].outputs[0]
    # Free-form keys and strings would run past max_tokens on random weights: the document wraps up.
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_match(llm, regex):
    outs = llm.generate(["a", "b", "c"], [constrained(i, regex=regex) for i in range(3)], use_tqdm=False)
    for out in outs:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", CHOICES)
def test_choice_outputs_are_one_of_them(llm, choice):
    outs = llm.generate(["a", "b", "c", "d"], [constrained(i, choice=choice) for i in range(4)], use_tqdm=False)
    assert all(o.outputs[0].text in choice for o in outs)


def test_lark_and_gbnf_grammars(llm):
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "ok " ("one" | "two") "!"'
    out = llm.generate("x", constrained(grammar=lark), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", out.text), out.text
    out = llm.generate("x", constrained(grammar=gbnf), use_tqdm=False)[0].outputs[0]
    assert out.text in ("ok one!", "ok two!")


def test_n_samples_each_follow_the_grammar_and_seed_reproduces(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["array of objects"]))
    first = llm.generate("Points:", params, use_tqdm=False)[0]
    again = llm.generate("Points:", params, use_tqdm=False)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    for c in first.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["array of objects"])


def test_unconstrained_neighbours_are_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["The capital of France is", "JSON:"], [plain, constrained(json=SCHEMAS["nested"])],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["nested"])


def test_compiled_once_per_schema(llm):
    manager = llm.llm_engine.structured_output
    schema = {"type": "object", "properties": {"only": {"enum": ["once"]}}, "required": ["only"]}
    before = manager.num_compiled
    llm.generate(["a", "b", "c"], [constrained(i, json=schema) for i in range(3)], use_tqdm=False)
    llm.generate("d", constrained(json=dict(schema)), use_tqdm=False)
    assert manager.num_compiled == before + 1


@pytest.mark.parametrize("so, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: ("), "grammar"),
])
def test_invalid_constraints_are_refused_before_queueing(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", constrained(**so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("so, message", [
    (dict(), "exactly one of"),
    (dict(json={}, regex="a"), "exactly one of"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(regex=""), "non-empty string"),
])
def test_params_validation(so, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**so)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_grammar_state(llama_path, mode, caplog):
    schema = SCHEMAS["array of objects"]
    prompts = [f"Request {i}: points as JSON" for i in range(6)]
    params = [constrained(i, temperature=1.0, max_tokens=120, json=schema) for i in range(6)]
    roomy = LLM(str(llama_path), max_model_len=160, num_kv_blocks=512, block_size=4)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 40 blocks of 4 = 160 slots: the six requests need about twice that at peak.
    tight = LLM(str(llama_path), max_model_len=160, num_kv_blocks=40, block_size=4, preemption_mode=mode,
                swap_space=0.05, max_num_batched_tokens=64, max_num_seqs=64)
    with caplog.at_level(logging.INFO, logger="pagellm.core.scheduler"):
        outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == expected
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_chat_renders_tools_through_the_template(llm):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ids = llm.llm_engine.apply_chat_template([{"role": "user", "content": "hi"}], template, True, tools=tools)
    assert llm.llm_engine.tokenizer.decode(ids) == "[get_weather]hi"
    out = llm.chat([{"role": "user", "content": "hi"}], constrained(json=SCHEMAS["enum"]), use_tqdm=False,
                   chat_template=template, tools=tools)
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMAS["enum"])


def test_keywords_the_engine_does_not_implement_are_ignored_not_refused(llm, caplog):
    schema = {"type": "object", "properties": {"v": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3,
                                                     "uniqueItems": True}}, "required": ["v"]}
    with caplog.at_level(logging.WARNING, logger="pagellm.structured_output"):
        out = llm.generate("x", constrained(json=schema), use_tqdm=False)[0].outputs[0]
    assert "uniqueItems" in caplog.text
    loose = {k: v for k, v in schema["properties"]["v"].items() if k != "uniqueItems"}
    jsonschema.validate(json.loads(out.text), {**schema, "properties": {"v": loose}})
