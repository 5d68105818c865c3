"""LangChain's structured output and tool binding against the real server (constrained decoding on a
random-weight model: the answers parse and validate because the grammar makes them)."""

from __future__ import annotations

from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.peers.conftest import API_KEY, MODEL

pytestmark = pytest.mark.peers


class Address(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture
def chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=1.0, max_tokens=300,
                      max_retries=0, seed=4)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model(chat, method):
    person = chat.with_structured_output(Person, method=method).invoke("Describe someone.")
    assert isinstance(person, Person)
    assert isinstance(person.address, Address)


def test_bind_tools_required_returns_valid_calls(chat):
    msg = chat.bind_tools([GetWeather], tool_choice="required").invoke("Weather in Rome?")
    assert msg.tool_calls
    for call in msg.tool_calls:
        assert call["name"] == "GetWeather"
        jsonschema.validate(call["args"], GetWeather.model_json_schema())
        GetWeather(**call["args"])


def test_streamed_tool_call_matches_the_invoked_one(chat):
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    invoked = bound.invoke("Weather?")
    chunks = list(bound.stream("Weather?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in invoked.tool_calls]
