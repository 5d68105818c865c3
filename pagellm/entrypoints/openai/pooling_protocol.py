"""Request bodies of the pooling routes: OpenAI's embeddings, vLLM's score, and the rerank shapes of
Jina and Cohere (``query``, ``documents``, ``top_n``, ``return_documents``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PoolingModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    # vLLM's: keep this many tokens of each input (-1: the model's limit) rather than refuse a long one.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None  # OpenAI's end-user id: accepted and ignored


class EmbeddingRequest(PoolingModel):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class ScoreRequest(PoolingModel):
    # vLLM's names (text_1 / text_2) and its newer ones (queries / documents).
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(PoolingModel):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    # Cohere's: each document is cut to its first max_tokens_per_doc tokens before it is scored.
    max_tokens_per_doc: int | None = Field(default=None, ge=1)


class ClassifyRequest(PoolingModel):
    input: str | list[str] | list[int] | list[list[int]]
