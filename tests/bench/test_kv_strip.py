"""The KV grid over a run as a PNG strip: the recorder's samples, the rows of a large pool, the command."""

from __future__ import annotations

from pagellm import LLM, SamplingParams
from pagellm.bench.kv_strip import STRIP_STATES, KVStripRecorder, plot_kv_strip, strip_rows
from pagellm.entrypoints.cli import main
from tests.bench.test_bench_commands import TINY


def test_rows_of_a_large_pool_show_each_group_s_most_common_state():
    grid, per_row = strip_rows(["ffuu" + "sscc", "cccc" + "fpuf"], num_blocks=8, max_rows=2)
    assert per_row == 4 and grid.shape == (2, 2)
    f, c, u, s, p = (STRIP_STATES.index(x) for x in "fcusp")
    # ffuu: a tie goes to the more telling state; sscc: likewise; cccc; fpuf: free is most common.
    assert grid[:, 0].tolist() == [u, s] and grid[:, 1].tolist() == [c, f]
    grid, per_row = strip_rows(["fus"], num_blocks=3)
    assert per_row == 1 and grid[:, 0].tolist() == [f, u, s]


def test_recorder_samples_the_grid_after_steps_within_a_bounded_number_of_columns(llama_path, tmp_path):
    llm = LLM(str(llama_path), max_model_len=256, num_kv_blocks=64, block_size=8, device="cpu")
    engine = llm.llm_engine
    recorder = KVStripRecorder.install(engine, max_columns=8)
    prefix = list(range(10, 42))
    llm.generate([prefix + [5]], SamplingParams(max_tokens=1), use_tqdm=False)  # the prefix is cached
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([prefix + [6], prefix + [7], prefix + [8]], params, use_tqdm=False)
    recorder.uninstall()
    assert recorder not in engine.step_observers
    assert 4 <= len(recorder.columns) < 8 and recorder.stride > 1  # halved as it filled
    assert all(len(col) == 64 for col in recorder.columns) and recorder.num_blocks == 64
    assert recorder.times == sorted(recorder.times) and recorder.times[-1] > 0
    assert any("s" in col for col in recorder.columns), "the three requests share the prefix blocks"
    assert set(recorder.columns[-1]) <= {"f", "c", "u", "s"}
    path = plot_kv_strip(tmp_path / "strip.png", recorder, "test")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_bench_memory_writes_the_strip_beside_the_usage_plot(tmp_path):
    rc = main(["bench", "memory", *TINY, "--output-len", "8", "8", "--output-dir", str(tmp_path)])
    assert rc == 0
    for suffix in ("kv-usage", "kv-grid"):
        assert (tmp_path / f"memory-random-tiny-llama-{suffix}.png").read_bytes()[:4] == b"\x89PNG"
