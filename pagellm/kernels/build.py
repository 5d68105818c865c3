"""Build and load the C kernels in ``csrc/`` (``native.py`` declares their functions and calls them).

The kernels are compiled on first use with the system C compiler (``$CC``, else ``cc``) for this
machine (``-march=native``, less the features hidden by ``PAGELLM_HIDE_CPU_FEATURES``: cpu_features.py):
each C file to an object, all at once in parallel, then linked into one
library, cached under ``$PAGELLM_CACHE_DIR`` (default ``~/.cache/pagellm``) and keyed by the sources
and headers, the flags, the compiler and the CPU (editing any file rebuilds), then loaded with
``ctypes``: no build step at install time and no CUDA toolchain. OpenMP threads come from the runtime
PyTorch already loaded. Where they cannot be built or loaded (no compiler, no OpenMP, an unwritable
cache folder), or with ``PAGELLM_NATIVE_KERNELS=0``, ``load_library()`` returns None (with a warning)
and callers use their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagellm.kernels.cpu_features import cpu_flags, gcc_flags  # noqa: F401 (cpu_flags re-exported)

# The messages keep the logger they had when this module was part of native.py.
logger = logging.getLogger("pagellm.kernels.native")

SOURCE_DIR = Path(__file__).with_name("csrc")  # the C files (one per op) and their header
LIBRARY_STEM = "cpu_kernels"  # the cached library: cpu_kernels-<key>.so
# OpenMP is required: without it the kernels would run on one thread, slower than PyTorch's
# multi-threaded path, which is then used instead. -lm after the objects (linkers drop unused
# libraries named before them).
COMPILE_FLAGS = ["-O3", "-march=native", "-fno-strict-aliasing", "-fopenmp", "-shared", "-fPIC"]
LINK_FLAGS = ["-lm"]
BUILD_TIMEOUT_S = 300


def compile_flags() -> list[str]:
    """COMPILE_FLAGS, and the switches that keep the kernels off the features hidden by
    ``PAGELLM_HIDE_CPU_FEATURES`` (cpu_features.py)."""
    return COMPILE_FLAGS + gcc_flags()


def cache_dir() -> Path:
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags", "Features")))
    except OSError:
        text += platform.processor()
    return text


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def sources(source: Path) -> list[Path]:
    """The C files to compile: every ``*.c`` of a folder (in name order), or ``source`` itself where it
    is one file (a single-file revision of the kernels, as ``benchmarks/kernel_ab.py`` builds)."""
    return sorted(source.glob("*.c")) if source.is_dir() else [source]


def cache_key(source: Path, cc: str) -> str:
    """What the cached library depends on: every C file and header (names and contents), the flags,
    the compiler and the CPU."""
    files = sorted(p for p in source.iterdir() if p.suffix in (".c", ".h")) if source.is_dir() else [source]
    parts = [part for p in files for part in (p.name.encode(), p.read_bytes())]
    parts += [" ".join(compile_flags() + LINK_FLAGS).encode(), _compiler_version(cc).encode(),
              _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(cc: str, source: Path, target: Path) -> str | None:
    """Compile ``source`` (a folder's C files, each to an object in parallel, linked into one library,
    or one C file) to ``target``, atomically; returns what went wrong, or None."""
    tmp = workdir = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        workdir = tempfile.mkdtemp(prefix=".build-", dir=target.parent)
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        flags = compile_flags()
        files = sources(source)
        objects = [os.path.join(workdir, f"{i}-{f.stem}.o") for i, f in enumerate(files)]
        compiles: list[subprocess.Popen] = []
        errors = []
        try:
            for f, o in zip(files, objects):
                compiles.append(subprocess.Popen([cc, *flags, "-c", str(f), "-o", o], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.PIPE, text=True))
            for f, proc in zip(files, compiles):
                _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
                if proc.returncode != 0:
                    errors.append(stderr.strip() or f"{cc} exited with {proc.returncode} on {f.name}")
        finally:
            for proc in compiles:  # after a failure to start or a timeout, the others are not waited for
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if errors:
            return "\n".join(errors)[-2000:]
        link = subprocess.run([cc, *flags, *objects, "-o", tmp, *LINK_FLAGS], capture_output=True, text=True,
                              timeout=max(deadline - time.monotonic(), 1))
        if link.returncode != 0:
            return link.stderr.strip()[-2000:] or f"{cc} exited with {link.returncode}"
        os.replace(tmp, target)  # concurrent builders each write their own file; the last one wins
        return None
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache folder, compiler gone, ...
        return str(e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def disabled() -> bool:
    return os.environ.get("PAGELLM_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def load_library(source: Path, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The kernels compiled from ``source``, built if needed, with ``declare`` run on them; None when
    disabled or when they cannot be built (warned)."""
    if disabled():
        logger.info("native kernels disabled by PAGELLM_NATIVE_KERNELS")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found (set CC): attention and sampling use the slower PyTorch path")
        return None
    path = cache_dir() / f"{LIBRARY_STEM}-{cache_key(source, cc)}.so"
    error = None
    for attempt in range(2):  # a cached library that no longer loads (another glibc?) is rebuilt once
        if attempt or not path.exists():
            hidden = f" (without the features PAGELLM_HIDE_CPU_FEATURES hides: {' '.join(gcc_flags())})" \
                if gcc_flags() else ""
            logger.info("compiling native CPU kernels for this CPU (first run only) ...%s", hidden)
            t0 = time.perf_counter()
            error = build(cc, source, path)
            if error is not None:
                break
            logger.info("compiled the native CPU kernels in %.1f s (cached in %s)", time.perf_counter() - t0,
                        path.parent)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            error = f"loading {path}: {e}"
            continue
        declare(lib)
        logger.info("native kernels loaded from %s", path)
        return lib
    logger.warning("native kernels could not be built (%s %s); attention and sampling use the slower "
                   "PyTorch path:\n%s", cc, " ".join(compile_flags()), error)
    return None
