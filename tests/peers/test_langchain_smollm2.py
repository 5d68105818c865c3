"""LangChain's structured output and tool binding on the embedded SmolLM2-135M-Instruct: models as
applications write them (unbounded strings and lists), answered greedily, parsed by LangChain."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.openai.server_utils import SMOLLM2_NAME as MODEL
from tests.entrypoints.openai.server_utils import needs_smollm2, smollm2_tool_server

pytestmark = [pytest.mark.peers, needs_smollm2]
server = pytest.fixture(scope="module")(smollm2_tool_server)


class Movie(BaseModel):
    """A movie and what it is about."""

    title: str
    year: int
    genres: list[str]
    summary: str = Field(description="one sentence")


class SearchFlights(BaseModel):
    """Search flights between two cities on a date."""

    origin: str
    destination: str
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")


@pytest.fixture
def chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=160,
                      max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model(chat, method):
    movie = chat.with_structured_output(Movie, method=method).invoke("Tell me about the movie Titanic.")
    assert isinstance(movie, Movie)
    assert movie.title


def test_bind_tools_required_returns_a_call_that_validates(chat):
    msg = chat.bind_tools([SearchFlights], tool_choice="required").invoke(
        "Find me a flight from Paris to Rome on 2025-03-14.")
    assert msg.tool_calls
    for call in msg.tool_calls:
        assert call["name"] == "SearchFlights"
        jsonschema.validate(call["args"], SearchFlights.model_json_schema())
        SearchFlights(**call["args"])
