"""PAGELLM_HIDE_CPU_FEATURES: any machine runs the paths of a machine without the hidden features, so
each path's selection is exercised wherever the suite runs (``make test-cpu-paths`` runs the kernel
tests under it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagellm.kernels import cpu_features
from pagellm.kernels.cpu_features import HIDE_ENV

# The flags of the three machine kinds the suite runs on (as /proc/cpuinfo lists them, abridged).
ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN4 = ZEN3 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture
def machine(monkeypatch):
    def use(flags: frozenset[str], hide: str = "") -> None:
        monkeypatch.setattr(cpu_features, "machine_flags", lambda: flags)
        monkeypatch.setenv(HIDE_ENV, hide)
    return use


@pytest.mark.parametrize(("flags", "hide", "isa", "gcc"), [
    (SAPPHIRE_RAPIDS, "", None, []),
    (SAPPHIRE_RAPIDS, "amx", "AVX512_CORE_BF16", ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
    (SAPPHIRE_RAPIDS, "avx512_bf16", "AVX512_CORE_VNNI",
     ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
    (SAPPHIRE_RAPIDS, "avx512", "AVX2_VNNI",
     ["-mno-avx512f", "-mno-avx512bf16", "-mno-avx512vnni", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]),
    (ZEN4, "avx512_bf16", "AVX512_CORE_VNNI", ["-mno-avx512bf16"]),
    (ZEN4, "amx", None, []),  # nothing this machine has: nothing changes
    (ZEN3, "avx2", "AVX", ["-mno-avx2"]),
    (ZEN3, "avx2, f16c fma", "AVX", ["-mno-avx2", "-mno-fma", "-mno-f16c"]),
    (ZEN4, "fma", "AVX", ["-mno-avx2", "-mno-fma", "-mno-avx512f", "-mno-avx512bf16", "-mno-avx512vnni"]),
])
def test_hidden_features_cap_every_path(machine, flags, hide, isa, gcc):
    machine(flags, hide)
    assert cpu_features.onednn_max_isa() == isa
    assert sorted(cpu_features.gcc_flags()) == sorted(gcc)
    visible = cpu_features.cpu_flags()
    assert visible <= flags and not visible & cpu_features.hidden_flags()


@pytest.mark.parametrize(("flags", "hide", "bf16"), [
    (SAPPHIRE_RAPIDS, "", True), (SAPPHIRE_RAPIDS, "amx", True), (SAPPHIRE_RAPIDS, "avx512_bf16", False),
    (ZEN4, "", True), (ZEN4, "avx512", False), (ZEN3, "", False),
])
def test_dtype_auto_and_the_linear_kernel_follow_the_visible_features(machine, flags, hide, bf16):
    """--dtype auto computes in bfloat16 only where the visible CPU has it; the native bfloat16 linear
    serves AVX512-BF16 machines whose AMX is absent or hidden (oneDNN's tiles win where it shows)."""
    from pagellm.kernels import native
    from pagellm.model import loader

    machine(flags, hide)
    assert loader.cpu_has_bf16() is bf16
    native._has_linear.cache_clear()
    try:
        lib = native.load()
        if lib is not None and lib.pagellm_linear_bf16_supported():  # compiled for AVX512-BF16 here
            assert native.linear_supported() is ("amx_bf16" not in cpu_features.cpu_flags())
        else:
            assert not native.linear_supported()
    finally:
        native._has_linear.cache_clear()


def test_an_unknown_feature_is_an_error_naming_the_known_ones(machine):
    machine(ZEN3, "avx3")
    with pytest.raises(ValueError, match=r"PAGELLM_HIDE_CPU_FEATURES='avx3': unknown CPU feature 'avx3'.*amx.*avx2"):
        cpu_features.cpu_flags()


@pytest.mark.slow
def test_torch_and_the_kernels_run_without_the_hidden_features(tmp_path):
    """A real process with AVX2 (and all above it) hidden: ATen and oneDNN are capped before torch
    loads, and the C kernels are built without AVX2 and still compute what PyTorch does."""
    if "avx2" not in cpu_features.machine_flags():
        pytest.skip("this CPU has no AVX2 to hide")
    code = (
        "import os, torch, pagellm\n"
        "from pagellm.kernels import build, native\n"
        "print(os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability())\n"
        "assert '-mno-avx2' in build.compile_flags()\n"
        "x = torch.randn(3, 64)\n"
        "w = torch.ones(64)\n"
        "assert native.load() is not None, 'the kernels did not build without AVX2'\n"
        "out = native.rms_norm(x, w, 1e-6)\n"
        "want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
        "assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()\n"
    )
    env = {**os.environ, HIDE_ENV: "avx2", "PAGELLM_CACHE_DIR": str(tmp_path)}
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    isa, capability = r.stdout.split("\n")[0].split()
    assert isa == "AVX" and capability == "DEFAULT"
