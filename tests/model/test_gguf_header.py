"""A malformed GGUF header gets one clear error, whatever is wrong with it: cut off at any offset,
fields with impossible counts, lengths, types or offsets, random bytes. Never a traceback from a
reader's internals, never a hang."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from pagellm import LLM
from pagellm.model import gguf_file, loader
from pagellm.model.gguf_header import read_header

VOCAB = [f"tok{i}" for i in range(40)]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """A small well-formed file: strings, an array of strings, scalars and two tensors (one quantized)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_token_list(VOCAB)
    writer.add_token_scores([0.0] * len(VOCAB))
    writer.add_tensor("token_embd.weight", np.arange(4 * 32, dtype=np.float32).reshape(4, 32))
    weights = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    writer.add_tensor("blk.0.attn_q.weight", quantize(weights, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def header_end(path: Path) -> int:
    """Where the tensor data begins."""
    return min(t.offset for t in read_header(path).tensors)


def assert_clean_error(path: Path) -> str:
    """Opening the file as a model fails with a ValueError that names the file (nothing else escapes)."""
    with pytest.raises(ValueError) as info:
        loader.resolve_model_files(path)
    message = str(info.value)
    assert path.name in message and ("GGUF" in message or "not a GGUF file" in message), message
    return message


def test_the_well_formed_file_reads(small_gguf):
    header = read_header(small_gguf, ("general.architecture", "llama.context_length"))
    assert header.fields == {"general.architecture": "llama", "llama.context_length": 64}
    assert [(t.name, t.dims) for t in header.tensors] == [("token_embd.weight", (32, 4)),
                                                          ("blk.0.attn_q.weight", (64, 2))]
    from gguf import GGUFReader

    reader = GGUFReader(str(small_gguf))  # the same tensor table as gguf's own reader
    assert [(t.name, t.data_offset, t.n_bytes) for t in reader.tensors] == [
        (t.name, t.offset, t.num_bytes) for t in header.tensors]


def test_a_file_cut_off_at_any_offset_gets_one_clear_error(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    end = header_end(small_gguf)
    data_end = max(t.offset + t.num_bytes for t in read_header(small_gguf).tensors)  # (padding may follow)
    cuts = list(range(0, end + 1)) + list(range(end + 1, data_end, 37))
    cut = tmp_path / "cut.gguf"
    messages = set()
    for n in cuts:
        cut.write_bytes(data[:n])
        messages.add(assert_clean_error(cut).split(":", 1)[0])
    # Past the magic bytes, every cut is reported as this file being unreadable.
    assert any("is not a readable GGUF file" in m for m in messages)


def _mangle(data: bytes, offset: int, code: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + code, out, offset, value)
    return bytes(out)


def test_impossible_header_fields_are_named(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    first_key = 24  # after magic, version, tensor count and metadata count
    key_length = struct.unpack_from("<Q", data, first_key)[0]
    value_type_at = first_key + 8 + key_length
    vocab_at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    cases = {
        "version": (_mangle(data, 4, "I", 99), "GGUF version 99"),
        "tensor count": (_mangle(data, 8, "Q", 2**62), "tensors"),
        "metadata count": (_mangle(data, 16, "Q", 2**40), "metadata entries"),
        "key length": (_mangle(data, first_key, "Q", 2**50), "metadata key #0"),
        "value type": (_mangle(data, value_type_at, "I", 77), "unknown value type 77"),
        "array count": (_mangle(data, vocab_at + 8, "Q", 2**45), "tokenizer.ggml.tokens"),
        "array item type": (_mangle(data, vocab_at + 4, "I", 66), "items of unknown type 66"),
        "key bytes": (data[:first_key + 8] + b"\xff" + data[first_key + 9:], "not UTF-8"),
    }
    tensor_table = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
    cases["dimension count"] = (_mangle(data, tensor_table, "I", 9), "9 dimensions")
    cases["tensor type"] = (_mangle(data, tensor_table + 4 + 16, "I", 4242), "unknown type 4242")
    cases["data offset"] = (_mangle(data, tensor_table + 4 + 16 + 4, "Q", 2**40), "run past the end")
    cases["unaligned offset"] = (_mangle(data, tensor_table + 4 + 16 + 4, "Q", 513), "not a multiple")
    path = tmp_path / "bad.gguf"
    for name, (bad, expected) in cases.items():
        path.write_bytes(bad)
        message = assert_clean_error(path)
        assert expected in message, (name, message)


def _with_metadata(data: bytes, entries: list[bytes]) -> bytes:
    """The file with metadata entries added after the existing ones (for files refused before their
    tensor table: the data is not realigned)."""
    count = struct.unpack_from("<Q", data, 16)[0]
    header = read_header_end_of_metadata(data)
    added = b"".join(entries)
    body = data[24:header] + added + data[header:]
    out = data[:16] + struct.pack("<Q", count + len(entries)) + body
    return out


def read_header_end_of_metadata(data: bytes) -> int:
    """Where the metadata of ``data`` (a file of the small fixture's shape) ends: its tensor table's start."""
    return data.index(struct.pack("<Q", len(b"token_embd.weight")) + b"token_embd.weight")


def _key(name: str, kind: int, payload: bytes) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", kind) + payload


def test_fields_gguf_itself_refuses_are_refused(small_gguf, tmp_path):
    """A repeated key, an alignment that is not a uint32 (a bool would read as 1: every tensor misplaced),
    arrays nested past any file's need (they would exhaust Python's stack)."""
    data = small_gguf.read_bytes()
    path = tmp_path / "fields.gguf"
    # An array of one array of one array ... (20 levels), the innermost an empty array of uint32.
    nested = struct.pack("<IQ", 9, 1) * 19 + struct.pack("<IQ", 4, 0)
    cases = {
        "repeated key": ([_key("llama.block_count", 4, struct.pack("<I", 2))], "appears twice"),
        "bool alignment": ([_key("general.alignment", 7, b"\x01")], "general.alignment must be a power of two"),
        "uint64 alignment": ([_key("general.alignment", 10, struct.pack("<Q", 32))], "of type uint32"),
        "deep arrays": ([_key("x.nested", 9, nested)], "nests arrays deeper than"),
    }
    for name, (entries, expected) in cases.items():
        path.write_bytes(_with_metadata(data, entries))
        message = assert_clean_error(path)
        assert expected in message, (name, message)


def test_a_big_endian_file_is_refused_by_name(tmp_path):
    from gguf import GGUFEndian, GGUFWriter

    path = tmp_path / "be.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(4 * 32, dtype=np.float32).reshape(4, 32).byteswap())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_header(path).byte_order == ">"
    with pytest.raises(ValueError, match="be.gguf is a big-endian GGUF file: pagellm reads little-endian files"):
        LLM(str(path))


def test_random_bytes_in_the_header_never_escape_as_another_error(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    end = header_end(small_gguf)
    rng = random.Random(0)
    path = tmp_path / "noise.gguf"
    accepted = 0
    for _ in range(300):
        mangled = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            mangled[rng.randrange(4, end)] = rng.randrange(256)
        path.write_bytes(bytes(mangled))
        try:
            read_header(path)
            accepted += 1  # a change the format allows (a value, a letter of a name)
        except ValueError as e:
            assert "is not a readable GGUF file" in str(e)
    assert accepted < 300


def test_a_header_that_reads_but_holds_nonsense_still_gets_a_clear_error(small_gguf, tmp_path):
    """Fields the header reader does not judge (a vocabulary's text) reach transformers, whose errors
    are turned into the same kind of message."""
    data = bytearray(small_gguf.read_bytes())
    at = data.index(b"tok7")
    data[at:at + 4] = b"\xff\xfe\xfd\xfc"  # a token that is not UTF-8
    path = tmp_path / "vocab.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"vocab\.gguf"):
        gguf_file.prepared_folder(path)


def test_an_already_quantized_file_is_not_quantized_again(tmp_path):
    from pagellm.model.default_model import build_checkpoint
    from tests.model.gguf_writer import write_gguf

    folder = build_checkpoint(tmp_path / "llama", "llama", seed=5)
    path = write_gguf(folder, tmp_path / "m-Q8_0.gguf", "Q8_0")
    for method in ("int8", "q4_0"):
        with pytest.raises(ValueError, match=rf"--quantization {method} .* m-Q8_0\.gguf is already quantized "
                                             r"\(\d+ tensors of Q8_0\).*Leave --quantization unset"):
            LLM(str(path), quantization=method, max_model_len=64, num_kv_blocks=8)
