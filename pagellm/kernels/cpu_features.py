"""The CPU's instruction-set features, and a switch that hides some of them.

Every path choice of the engine (which kernels the C library compiles, whether the native bfloat16
linear or oneDNN runs the linears, whether ``--dtype auto`` picks bfloat16, which ISA oneDNN and ATen
dispatch to) reads the features from here, so that ``PAGELLM_HIDE_CPU_FEATURES`` makes a machine
behave as one without them: an AMX machine runs the AVX512-BF16 paths, an AVX-512 machine the AVX2
paths, any x86 machine the portable C loops. The suite runs under it (``make test-cpu-paths``) so
each path's selection is exercised on whatever machine CI has.

Names are the kernel's flag names in ``/proc/cpuinfo`` (``amx_bf16``, ``avx512_bf16``, ``avx2``, ...)
or the groups ``amx`` and ``avx512``; hiding a feature hides the ones built on it (``avx2`` hides
AVX-512, AVX-VNNI and AMX too). Only hiding is possible: a feature the CPU lacks cannot be pretended.

Imported by ``pagellm/__init__.py`` without torch: ``configure_torch_dispatch`` must set oneDNN's and
ATen's environment switches before they read them.
"""

from __future__ import annotations

import functools
import os

HIDE_ENV = "PAGELLM_HIDE_CPU_FEATURES"

_AMX = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex")
_AVX512 = ("avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2",
           "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "avx512_vp2intersect")
# A name a user may hide -> every flag that goes with it (the features built on it included).
_HIDES: dict[str, tuple[str, ...]] = {
    "amx": _AMX,
    **{f: (f,) for f in _AMX[1:]},
    "amx_tile": _AMX,
    "avx512": _AVX512 + _AMX,
    "avx512f": _AVX512 + _AMX,
    # The bfloat16 ladder: AMX's bfloat16 tiles are the step above AVX512-BF16 (as oneDNN orders them).
    "avx512_bf16": ("avx512_bf16", *_AMX),
    "avx512_vnni": ("avx512_vnni", "avx512_bf16", *_AMX),
    "avx_vnni": ("avx_vnni",),
    "avx2": ("avx2", "avx_vnni", *_AVX512, *_AMX),
    # x86-64-v3 goes together: ATen's AVX2 kernels and oneDNN's need FMA, the kernels' AVX2 paths F16C.
    "fma": ("fma", "avx2", "avx_vnni", *_AVX512, *_AMX),
    "f16c": ("f16c", "avx2", "avx_vnni", *_AVX512, *_AMX),
}
# The flags' GCC switches: compiled with -march=native, the C kernels would otherwise still use them.
_GCC_OFF = {
    "avx2": "-mno-avx2", "fma": "-mno-fma", "f16c": "-mno-f16c", "avx_vnni": "-mno-avxvnni",
    "avx512f": "-mno-avx512f", "avx512_bf16": "-mno-avx512bf16", "avx512_vnni": "-mno-avx512vnni",
    "amx_tile": "-mno-amx-tile", "amx_bf16": "-mno-amx-bf16", "amx_int8": "-mno-amx-int8",
}
# oneDNN's ISA levels, highest first, with the flags each needs (ONEDNN_MAX_CPU_ISA's values).
_ONEDNN_LEVELS = (
    ("AVX512_CORE_AMX", ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f")),
    ("AVX512_CORE_BF16", ("avx512_bf16", "avx512_vnni", "avx512f", "avx512bw", "avx512vl")),
    ("AVX512_CORE_VNNI", ("avx512_vnni", "avx512f", "avx512bw", "avx512vl")),
    ("AVX512_CORE", ("avx512f", "avx512bw", "avx512vl")),
    ("AVX2_VNNI", ("avx2", "fma", "avx_vnni")),
    ("AVX2", ("avx2", "fma")),
    ("AVX", ("avx",)),
    ("SSE41", ()),
)


def hidden_names() -> tuple[str, ...]:
    """The names ``PAGELLM_HIDE_CPU_FEATURES`` lists (comma or space separated); ValueError for one
    that is not a feature this switch knows."""
    raw = os.environ.get(HIDE_ENV, "")
    names = tuple(n for n in raw.replace(",", " ").lower().split() if n)
    unknown = [n for n in names if n not in _HIDES]
    if unknown:
        raise ValueError(f"{HIDE_ENV}={raw!r}: unknown CPU feature {', '.join(map(repr, unknown))}; "
                         f"it hides any of: {', '.join(sorted(_HIDES))}")
    return names


def hidden_flags() -> frozenset[str]:
    """Every /proc/cpuinfo flag the switch hides (the features built on the named ones included)."""
    return frozenset(flag for name in hidden_names() for flag in _HIDES[name])


@functools.cache
def machine_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere), nothing hidden."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The features the engine may use: the CPU's, less the hidden ones."""
    return machine_flags() - hidden_flags()


def gcc_flags() -> list[str]:
    """The compiler switches that keep the C kernels off the hidden features (none when nothing is
    hidden, so the library's cache key is unchanged)."""
    hidden = hidden_flags() & machine_flags()
    return [switch for flag, switch in _GCC_OFF.items() if flag in hidden]


def onednn_max_isa() -> str | None:
    """The ``ONEDNN_MAX_CPU_ISA`` value that keeps oneDNN off the hidden features; None when nothing
    the machine has is hidden."""
    if not hidden_flags() & machine_flags():
        return None
    visible = cpu_flags()
    return next(level for level, needs in _ONEDNN_LEVELS if all(f in visible for f in needs))


def configure_torch_dispatch() -> None:
    """Cap oneDNN's and ATen's instruction sets below the hidden features (before torch reads them;
    a value the user set stays)."""
    try:
        isa = onednn_max_isa()
    except ValueError:  # a bad switch is reported where the flags are read, with the engine's errors
        return
    if isa is None:
        return
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", isa)
    os.environ.setdefault("DNNL_MAX_CPU_ISA", isa)
    visible = cpu_flags()
    os.environ.setdefault("ATEN_CPU_CAPABILITY",
                          "avx512" if "avx512f" in visible else "avx2" if {"avx2", "fma"} <= visible else "default")
