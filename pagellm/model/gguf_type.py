"""A GGUF file's quantization as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``F16``), for reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass
class GGUFTypes:
    """The file's type and how many tensors of each type (``Q4_1``, ``F32``, ...) it holds."""

    file_type: str
    tensor_types: Counter[str]

    def tensor_summary(self) -> str:
        """``Q4_1: 210, F32: 61, Q8_0: 1``, most common first."""
        return ", ".join(f"{name}: {n}" for name, n in self.tensor_types.most_common())


def gguf_types(path: Path) -> GGUFTypes:
    """The file's type: its ``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``) where it has one, else
    the most common type of its quantized tensors (of all its tensors where none is quantized)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    from pagellm.model.gguf_header import read_header

    # The header's tensor table and one metadata value: decoding the whole metadata (a 50k-token
    # vocabulary) as gguf's reader does takes seconds.
    header = read_header(path, ("general.file_type",))
    counts = Counter(GGMLQuantizationType(t.type).name for t in header.tensors)
    file_type = header.fields.get("general.file_type")
    if isinstance(file_type, int):
        try:
            name = LlamaFileType(file_type).name
        except ValueError:  # a type newer than this gguf package
            name = ""
        if name and name != "GUESSED":
            return GGUFTypes(name.removeprefix("MOSTLY_").removeprefix("ALL_"), counts)
    quantized = Counter({k: n for k, n in counts.items() if k not in FLOAT_TYPES})
    most = (quantized or counts).most_common(1)
    return GGUFTypes(most[0][0] if most else "unknown", counts)
