"""GGUF files split by llama.cpp's gguf-split load as one model: the first part's metadata, every
part's tensors."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.model.gguf_file import gguf_parts
from tests.model.gguf_writer import write_gguf


def test_a_split_file_gives_the_whole_files_tokens_and_a_missing_part_is_named(llama_path, tmp_path):
    whole = write_gguf(llama_path, tmp_path / "whole.gguf", "Q8_0")
    (tmp_path / "split").mkdir()
    first = write_gguf(llama_path, tmp_path / "split" / "tiny.gguf", "Q8_0", split_max_tensors=6)
    parts = gguf_parts(first)
    assert len(parts) > 2 and parts[0] == first and gguf_parts(whole) == [whole]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(whole), max_model_len=64, num_kv_blocks=16).generate(["Hello there"], greedy, use_tqdm=False)
    got = LLM(str(first), max_model_len=64, num_kv_blocks=16).generate(["Hello there"], greedy, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    parts[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"split in {len(parts)}: {parts[-1].name} missing"):
        gguf_parts(first)
