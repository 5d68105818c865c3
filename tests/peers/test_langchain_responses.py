"""LangChain's ``ChatOpenAI(use_responses_api=True)`` (the Responses API, ``/v1/responses``) on the
embedded SmolLM2-135M-Instruct: plain and streamed answers, structured output, a tool call and its
result sent back, and ``previous_response_id``."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME as MODEL
from tests.entrypoints.openai.server_utils import needs_smollm2, smollm2_tool_server

pytestmark = [pytest.mark.peers, needs_smollm2]
server = pytest.fixture(scope="module")(smollm2_tool_server)


class Capital(BaseModel):
    """A country's capital city."""

    country: str
    capital: str


class SearchFlights(BaseModel):
    """Search flights between two cities on a date."""

    origin: str
    destination: str
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")


def responses_chat(server, **kwargs):
    from langchain_openai import ChatOpenAI

    options = {"temperature": 0, "max_tokens": 60, "max_retries": 0, **kwargs}
    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", use_responses_api=True, **options)


def test_invoke_and_stream_answer_through_the_responses_api(server):
    chat = responses_chat(server)
    msg = chat.invoke("What is the capital of France?")
    assert msg.text.strip()
    assert msg.id.startswith("resp_") and msg.content[0]["id"].startswith("msg_")
    assert msg.usage_metadata["input_tokens"] > 0 and msg.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in chat.stream("What is the capital of France?"))
    assert streamed == msg.text  # greedy: the same answer, in pieces


def test_structured_output_through_text_format(server):
    capital = responses_chat(server, max_tokens=80).with_structured_output(Capital, method="json_schema").invoke(
        "What is the capital of France?")
    assert isinstance(capital, Capital) and capital.capital


def test_a_tool_call_and_its_result_sent_back(server):
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = responses_chat(server)
    question = HumanMessage("Find me a flight from Paris to Rome on 2025-03-14.")
    msg = chat.bind_tools([SearchFlights], tool_choice="required").invoke([question])
    (call,) = msg.tool_calls
    assert call["name"] == "SearchFlights" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], SearchFlights.model_json_schema())
    result = ToolMessage("Flight AZ 331 leaves Paris at 09:40.", tool_call_id=call["id"])
    answer = chat.bind_tools([SearchFlights], tool_choice="none").invoke([question, msg, result])
    assert answer.text.strip() and not answer.tool_calls


def test_previous_response_id_sends_only_the_new_turn(server):
    from langchain_core.messages import HumanMessage

    chat = responses_chat(server, use_previous_response_id=True, max_tokens=20)
    first = chat.invoke([HumanMessage("My name is Ann.")])
    second = chat.invoke([HumanMessage("My name is Ann."), first, HumanMessage("What is my name?")])
    assert second.text.strip()
    stored = httpx.get(f"{server.url}/v1/responses/{second.id}").json()
    assert stored["previous_response_id"] == first.id  # LangChain sent the new turn alone,
    # and the server rebuilt the conversation from the stored first response.
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] + 5
