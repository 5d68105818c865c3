"""Benchmark results a person can read: JSON, a markdown table row, PNG plots."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path


def append_markdown_row(path: Path, columns: list[str], values: list[Any]) -> Path:
    """Append one row to a markdown table, writing the header first if the file is new."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("| " + " | ".join(columns) + " |\n")
            f.write("|" + "---|" * len(columns) + "\n")
        f.write("| " + " | ".join(fmt(v) for v in values) + " |\n")
    return path


def warn_if_no_plots() -> None:
    """Said before any work: without matplotlib the results and tables are written, the plots skipped."""
    if _pyplot() is None:
        print("matplotlib is not installed: results and tables will be written, plots skipped "
              "(pip install 'pagellm[bench]' for them)")


def _pyplot() -> Any:
    """pyplot, or None (plots skipped) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def progress(backend: str, total: int, unit: str = "req") -> Any:
    """The progress bar of one backend's run (on stderr, so stdout keeps the results)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{backend:>12}", unit=unit, dynamic_ncols=True, leave=True)


def bar_plot(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, values, color=["#2a7" if lbl == "pagellm" else "#889" for lbl in labels])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(path: Path, series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str,
              title: str, log_x: bool = False) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=name)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None
