"""The dashboard's block grid over a benchmark run, as a PNG strip: time on x, block ids on y, each
block coloured by its state (free, in use, shared, cached, pinned) after each sampled step.

The companion of the KV usage plot (``throughput.plot_kv_usage``), on the same clock: the model time
summed over the steps. A step observer like ``StepLog``; it samples every ``stride``-th step and
doubles the stride (dropping every other column) when it holds ``max_columns``, so a long run costs
a bounded number of passes over the pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagellm.bench.report import _pyplot
from pagellm.engine.kv_state import CACHED, FREE, PINNED, SHARED, STATE_COLOURS, STATE_NAMES, USED, block_state_codes

# Drawing order of the states, and which wins a row that holds several blocks: the most common one,
# ties to the later (the more telling) state.
STRIP_STATES = (FREE, CACHED, USED, SHARED, PINNED)
MAX_ROWS = 512


class KVStripRecorder:
    """Samples the pool's block states after steps (install with ``KVStripRecorder.install(engine)``)."""

    def __init__(self, max_columns: int = 400) -> None:
        self.max_columns = max(2, max_columns)
        self.times: list[float] = []  # model seconds at each column
        self.columns: list[str] = []  # block_state_codes at each column
        self.num_blocks = 0
        self.stride = 1
        self._steps = 0
        self._clock = 0.0
        self._engine: Any = None

    @classmethod
    def install(cls, engine: Any, max_columns: int = 400) -> KVStripRecorder:
        recorder = cls(max_columns)
        recorder._engine = engine
        recorder.num_blocks = engine.kv_cache_manager.num_blocks
        engine.step_observers.append(recorder)
        return recorder

    def uninstall(self) -> None:
        if self._engine is not None:
            self._engine.step_observers.remove(self)
            self._engine = None

    def executed(self, engine: Any, scheduler_output: Any, seconds: float) -> None:
        self._clock += seconds

    def updated(self, engine: Any) -> None:
        if self._steps % self.stride == 0:
            self.times.append(self._clock)
            self.columns.append(block_state_codes(engine.kv_cache_manager))
            if len(self.columns) >= self.max_columns:
                # Keep the columns at multiples of the doubled stride (every other one).
                self.times, self.columns = self.times[::2], self.columns[::2]
                self.stride *= 2
        self._steps += 1


def strip_rows(columns: list[str], num_blocks: int, max_rows: int = MAX_ROWS) -> tuple[Any, int]:
    """(rows x columns array of indices into ``STRIP_STATES``, blocks per row): a pool larger than
    ``max_rows`` is drawn with several blocks per row, each row showing its most common state."""
    import numpy as np

    per_row = -(-num_blocks // max_rows) if num_blocks > max_rows else 1
    rows = -(-num_blocks // per_row)
    lookup = np.zeros(256, dtype=np.int8)
    for i, code in enumerate(STRIP_STATES):
        lookup[ord(code)] = i
    out = np.zeros((rows, len(columns)), dtype=np.int8)
    for j, codes in enumerate(columns):
        states = lookup[np.frombuffer(codes.encode("ascii"), dtype=np.uint8)]
        padded = np.zeros(rows * per_row, dtype=np.int8)  # the pad rows' blocks count as free
        padded[: len(states)] = states
        groups = padded.reshape(rows, per_row)
        counts = np.stack([(groups == i).sum(axis=1) for i in range(len(STRIP_STATES))], axis=1)
        # argmax takes the first of equal counts: reversed, the later state wins a tie.
        out[:, j] = len(STRIP_STATES) - 1 - np.argmax(counts[:, ::-1], axis=1)
    return out, per_row


def plot_kv_strip(path: Path, recorder: KVStripRecorder, title: str) -> Path | None:
    """Write the strip as a PNG; None where matplotlib is missing or nothing was recorded."""
    plt = _pyplot()
    if plt is None or not recorder.columns:
        return None
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    grid, per_row = strip_rows(recorder.columns, recorder.num_blocks)
    colours = [STATE_COLOURS[code] for code in STRIP_STATES]
    cmap = ListedColormap(colours)
    norm = BoundaryNorm(np.arange(len(STRIP_STATES) + 1) - 0.5, len(STRIP_STATES))
    times = np.asarray(recorder.times, dtype=float)
    # Column edges halfway between samples: a column spans the time until the next sample.
    if len(times) > 1:
        mids = (times[1:] + times[:-1]) / 2
        edges = np.concatenate([[times[0] - (mids[0] - times[0])], mids, [times[-1] + (times[-1] - mids[-1])]])
    else:
        edges = np.array([times[0] - 0.5, times[0] + 0.5])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.pcolormesh(edges, np.arange(grid.shape[0] + 1) * per_row, grid, cmap=cmap, norm=norm, shading="flat",
                  rasterized=True)
    ax.set_ylim(recorder.num_blocks, 0)  # block 0 at the top, as in the dashboard's grid
    ax.set_xlabel("time (s)")
    ax.set_ylabel("block id" + (f" ({per_row} per row)" if per_row > 1 else ""))
    ax.set_title(title)
    ax.legend(handles=[Patch(color=STATE_COLOURS[c], label=STATE_NAMES[c]) for c in STRIP_STATES],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

