"""Constrained decoding on checkpoints whose tokenizer and embedding disagree in size: a tokenizer with
ids past the embedding (transformers adds some to real checkpoints) and an embedding padded past the
tokenizer (real Qwen checkpoints)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.model.default_model import build_checkpoint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("extra", [-4, 64], ids=["tokenizer-outgrows-embedding", "embedding-padded"])
def test_structured_outputs_whatever_the_sizes(tmp_path, extra):
    folder = tmp_path / "model"
    size = len(AutoTokenizer.from_pretrained(str(build_checkpoint(folder))))
    build_checkpoint(folder, vocab_size=size + extra)
    llm = LLM(str(folder), max_model_len=256, num_kv_blocks=64)
    assert llm.llm_engine.vocab_size == size + extra
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert all(t < size + extra for t in out.token_ids)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text)["n"], int)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("x", choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
