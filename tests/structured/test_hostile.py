"""Hostile output constraints: none may crash the process, stall other requests, or pass for satisfied
when it cannot be. Offline through ``LLM`` (the engine's compiler), and through the real server."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.config import EngineArgs
from pagellm.structured_output import compiler
from pagellm.structured_output.limits import ConstraintLimits, check_constraint, count_rules, json_depth
from tests.entrypoints.openai.server_utils import RemoteServer


def lark_chain(n: int) -> str:
    """A grammar of ``n`` rules, each only naming the next: as deep as it is long."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int) -> dict:
    """A JSON schema whose ``$ref``s nest objects ``n`` levels deep."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


SELF_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
MUTUAL_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}
ANY_OF_CYCLE = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}
REPETITION_BOMB = {"type": "string", "pattern": "^a{1000000}$"}


# ---------------------------------------------------------------- the limits, before the grammar engine
@pytest.mark.parametrize("so, limits, message", [
    (StructuredOutputsParams(regex="a" * 300), ConstraintLimits(max_bytes=256), "--structured-outputs-max-bytes"),
    (StructuredOutputsParams(choice=["x" * 200_000, "y" * 100_000]), ConstraintLimits(),
     "--structured-outputs-max-bytes"),
    (StructuredOutputsParams(grammar=gbnf_chain(6000)), ConstraintLimits(), "--structured-outputs-max-rules"),
    (StructuredOutputsParams(grammar=lark_chain(10)), ConstraintLimits(max_rules=5), "defines 12 rules"),
    (StructuredOutputsParams(json={"a": [[[[{"b": 1}]]]]}), ConstraintLimits(max_depth=4),
     "--structured-outputs-max-depth"),
    (StructuredOutputsParams(choice=[str(i) for i in range(5000)]), ConstraintLimits(), "at most 1999"),
])
def test_constraints_beyond_a_limit_are_refused_naming_it(so, limits, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_constraint(so, limits)


def test_depth_and_rules_are_measured_without_recursion():
    deep: list = []
    for _ in range(100_000):  # far deeper than Python's recursion limit
        deep = [deep]
    assert json_depth(deep, stop_at=50) == 51
    assert json_depth({"a": [1, {"b": 2}]}, stop_at=10) == 3
    assert count_rules(lark_chain(3)) == 5
    assert count_rules("?expr.2: a\n  | b\nNUMBER: /[0-9]+/\n") == 2


@pytest.mark.parametrize("flag, value", [("--structured-outputs-max-bytes", 0),
                                         ("--structured-outputs-compile-timeout", -1.0),
                                         ("--structured-outputs-max-mask-ms", float("inf"))])
def test_limit_flags_are_validated(flag, value):
    name = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=re.escape(flag)):
        EngineArgs(**{name: value})


# ------------------------------------------------------------------------------------ offline
@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=512, num_kv_blocks=256, structured_outputs_compile_timeout=5.0)


def generate(llm: LLM, max_tokens: int = 8, **so) -> object:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**so))
    return llm.generate("x", params, use_tqdm=False)[0].outputs[0]


def test_deep_grammars_and_schemas_compile_instead_of_crashing(llm):
    # The chain of 3,500 rules overflows an 8 MiB stack (a segfault) on an ordinary thread.
    assert generate(llm, grammar=lark_chain(3500)).text == "a"
    assert generate(llm, grammar=gbnf_chain(1500)).text == "a"
    out = generate(llm, max_tokens=40, json=ref_chain(1000))
    assert out.text.startswith('{"x": {"x": {"x": ')


def test_a_grammar_that_would_crash_kills_only_the_probe(llm, monkeypatch):
    monkeypatch.setattr(compiler, "STACK_MB", 8)  # as small as an ordinary thread's: the chain overflows it
    manager = llm.llm_engine.structured_output
    manager.compiler._probe.kill()  # the next probe starts with the small stack
    try:
        with pytest.raises(ValueError, match="too deeply nested for the grammar engine"):
            generate(llm, grammar=lark_chain(4000))
    finally:
        monkeypatch.undo()
        manager.compiler._probe.kill()
    assert generate(llm, regex="[0-9]{3}").text.isdigit()  # a fresh probe serves the next one
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("schema", [SELF_CYCLE, MUTUAL_CYCLE, ANY_OF_CYCLE], ids=["self", "mutual", "anyOf"])
def test_unsatisfiable_schemas_are_refused(llm, schema):
    with pytest.raises(ValueError, match="can never be satisfied"):
        generate(llm, json=schema)


@pytest.mark.parametrize("so, message", [
    (dict(json=REPETITION_BOMB), "gives up after its first tokens"),
    (dict(grammar='start: "' + "ab" * 50_000 + '"'), "--structured-outputs-max-mask-ms"),
])
def test_constraints_too_costly_to_enforce_are_refused(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(llm, **so)


def test_a_constraint_that_dead_ends_later_finishes_with_error(llm):
    # The probe walks the lowest token ids ("a", which ends the output); this request is steered into
    # the other branch, whose repetition the grammar engine cannot follow.
    tokenizer = llm.get_tokenizer()
    b = tokenizer.convert_tokens_to_ids("b")
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={b: 100.0},
                            structured_outputs=StructuredOutputsParams(grammar='start: "a" | "b" "x"{1000000}'))
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("b")
    assert out.finish_reason == "error"
    blocks = llm.llm_engine.scheduler.kv_cache_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_slow_constraint_is_refused_when_its_time_is_spent(llama_path):
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=64, structured_outputs_compile_timeout=0.3,
              structured_outputs_max_rules=10000)
    started = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.3 s to compile.*--structured-outputs-compile-timeout"):
        generate(llm, grammar=gbnf_chain(4000))
    assert time.monotonic() - started < 3
    assert generate(llm, choice=["yes", "no"]).text in ("yes", "no")  # the next probe is fresh


# ------------------------------------------------------------------------------------- server
API_KEY = "hostile-key"


@pytest.fixture(scope="module")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", "tiny", "--max-model-len", "1024", "--num-kv-blocks",
                                    "256", "--structured-outputs-compile-timeout", "4",
                                    "--structured-outputs-max-rules", "20000"], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("body, message", [
    ({"structured_outputs": {"grammar": lark_chain(3500)}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_CYCLE}}},
     "can never be satisfied"),
    # The call's name comes first: the cycle dead-ends only at the arguments.
    ({"tools": [tool(MUTUAL_CYCLE)], "tool_choice": "required", "max_tokens": 200}, "finish_reason error"),
    ({"structured_outputs": {"choice": [f"option {i}" for i in range(60_000)]}}, "--structured-outputs-max-bytes"),
    ({"structured_outputs": {"json": REPETITION_BOMB}}, "gives up after its first tokens"),
])
def test_hostile_constraints_get_a_400_and_the_server_lives(server, body, message):
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    if message is None:
        assert r.status_code == 200, r.text
    elif message == "finish_reason error":
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "error"
    else:
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_a_compiling_constraint_holds_up_no_other_request(server, aclient):
    """While a constraint compiles until its time budget is spent, a plain request is answered and a
    running stream keeps streaming."""
    async def hostile() -> float:
        try:
            await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"structured_outputs": {"grammar": gbnf_chain(12_000)}})
        except openai.BadRequestError as e:
            assert "took longer than 4 s" in str(e)
        return time.monotonic()

    async def stream() -> tuple[list[float], float]:
        arrivals: list[float] = []
        s = await aclient.completions.create(model="tiny", prompt="Once upon a time", max_tokens=300,
                                             stream=True, extra_body={"ignore_eos": True})
        async for _ in s:
            arrivals.append(time.monotonic())
        return arrivals, time.monotonic()

    async def victim() -> float:
        await asyncio.sleep(0.5)
        await aclient.completions.create(model="tiny", prompt="The victim", max_tokens=8)
        return time.monotonic()

    async def run() -> tuple[float, tuple[list[float], float], float]:
        return await asyncio.gather(hostile(), stream(), victim())

    hostile_done, (arrivals, _), victim_done = asyncio.run(run())
    assert victim_done < hostile_done - 1.0  # answered while the constraint was still compiling
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 100 and max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
