"""pydantic-ai agents with tools against a server started with no tool flags: pydantic-ai sends
``tool_choice: "auto"`` whenever an agent has tools (a 400 before tool calls worked without flags)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME, RemoteServer, needs_smollm2, smollm2_tool_server

pytestmark = pytest.mark.peers
smollm2 = pytest.fixture(scope="module")(smollm2_tool_server)


class Weather(BaseModel):
    city: str = Field(max_length=12)
    degrees: int = Field(ge=-50, le=60)


def agent_for(url: str, model: str, **kwargs):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=url + "/v1", api_key="none")), **kwargs)


@needs_smollm2
def test_an_agent_with_a_tool_runs_on_the_embedded_model(smollm2):
    agent = agent_for(smollm2.url, SMOLLM2_NAME, system_prompt="You answer questions about the weather.")
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny and 21 degrees in {city}."

    result = agent.run_sync("What is the weather in Paris right now?",
                            model_settings={"temperature": 0, "max_tokens": 80})
    # SmolLM2-135M answers this in text (it rarely calls a tool); the run completes either way, and a
    # call it makes reaches the tool with a city.
    assert isinstance(result.output, str) and result.output
    assert all(isinstance(city, str) and city for city in calls)


def test_a_tool_call_in_the_generic_format_is_the_agents_output(llama_path):
    """The tiny model, pushed by a logit bias to start with ``<``, can only call: pydantic-ai reads the
    call of its output tool as the run's structured output."""
    from pydantic_ai import ToolOutput

    srv = RemoteServer(llama_path, ["--served-model-name", "tiny", "--max-model-len", "1024",
                                    "--num-kv-blocks", "256"])
    try:
        (first, *_) = AutoTokenizer.from_pretrained(str(llama_path)).encode("<tool_call>", add_special_tokens=False)
        agent = agent_for(srv.url, "tiny", output_type=[ToolOutput(Weather, name="report_weather"), str])
        settings = {"temperature": 0, "max_tokens": 200, "parallel_tool_calls": False,
                    "extra_body": {"logit_bias": {str(first): 100}}}
        result = agent.run_sync("What is the weather in Paris?", model_settings=settings)
        assert isinstance(result.output, Weather)  # (validated by pydantic-ai against the tool's schema)
    finally:
        assert srv.stop() == 0
