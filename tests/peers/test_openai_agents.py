"""The OpenAI Agents SDK with its default model (the Responses API, ``/v1/responses``) on the embedded
SmolLM2-135M-Instruct: an answer, a streamed run, a function tool called and its result sent back,
a typed output, and a run that continues a stored response by ``previous_response_id``."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import BaseModel

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME as MODEL
from tests.entrypoints.openai.server_utils import needs_smollm2, smollm2_tool_server

pytestmark = [pytest.mark.peers, needs_smollm2]
server = pytest.fixture(scope="module")(smollm2_tool_server)


class Capital(BaseModel):
    country: str
    capital: str


@pytest.fixture
def agents(server):
    """The SDK, its default client pointed at the server, tracing off (it would export to OpenAI). A
    client per test: each test runs one event loop, which the client's connections belong to."""
    import agents
    from openai import AsyncOpenAI

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        agents.set_tracing_disabled(True)
        agents.set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
                                         use_for_tracing=False)
        agents.set_default_openai_api("responses")
        yield agents


def agent(agents, **kwargs):
    settings = agents.ModelSettings(temperature=0, max_tokens=kwargs.pop("max_tokens", 200),
                                    tool_choice=kwargs.pop("tool_choice", None))
    return agents.Agent(name="assistant", model=MODEL, model_settings=settings,
                        **kwargs)


def test_a_run_and_a_streamed_run_answer(agents):
    async def runs() -> tuple[object, object, list[str]]:
        result = await agents.Runner.run(agent(agents), "What is the capital of France?")
        streamed = agents.Runner.run_streamed(agent(agents), "What is the capital of France?")
        kinds = [ev.data.type async for ev in streamed.stream_events() if ev.type == "raw_response_event"]
        return result, streamed.final_output, kinds

    result, final, kinds = asyncio.run(runs())
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.last_response_id.startswith("resp_")
    assert result.raw_responses[0].usage.output_tokens > 0
    assert final == result.final_output  # greedy: the same answer
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds


def test_a_function_tool_called_and_its_result_sent_back(agents):
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def runs() -> tuple[object, object]:
        # A call the model must make (whether a 135M model calls a tool under "auto" is its own
        # choice); the run ends at the tool's output.
        first = await agents.Runner.run(agent(agents, tools=[get_weather], tool_choice="required",
                                              tool_use_behavior="stop_on_first_tool"), "What is the weather in Paris?")
        # The call and its output go back as function_call and function_call_output items.
        follow_up = [*first.to_input_list(), {"role": "user", "content": "Answer in one word: is it sunny?"}]
        return first, await agents.Runner.run(agent(agents, tools=[get_weather], tool_choice="none"), follow_up)

    first, answer = asyncio.run(runs())
    assert len(cities) == 1 and cities[0]
    assert [item.type for item in first.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert first.final_output == f"It is sunny in {cities[0]}."
    sent = [item.get("type") for item in first.to_input_list()]
    assert "function_call" in sent and "function_call_output" in sent
    assert isinstance(answer.final_output, str) and answer.final_output.strip()


def test_a_typed_output_through_text_format(agents):
    result = asyncio.run(agents.Runner.run(agent(agents, output_type=Capital), "What is the capital of France?"))
    assert isinstance(result.final_output, Capital) and result.final_output.capital


def test_previous_response_id_continues_a_stored_response(server, agents):
    async def runs() -> tuple[object, object]:
        first = await agents.Runner.run(agent(agents), "My name is Ann.")
        return first, await agents.Runner.run(agent(agents), "What is my name?",
                                              previous_response_id=first.last_response_id)

    first, second = asyncio.run(runs())
    assert second.final_output.strip()
    stored = httpx.get(f"{server.url}/v1/responses/{second.last_response_id}").json()
    assert stored["previous_response_id"] == first.last_response_id
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[0].usage.input_tokens
