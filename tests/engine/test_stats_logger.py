"""The server's periodic engine-statistics line (vLLM's; --disable-log-stats turns it off)."""

from __future__ import annotations

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.stats_logger import StatsLogger


def test_a_line_per_interval_while_busy_and_none_when_idle(llama_path, caplog):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=32))
    stats_logger = StatsLogger(engine, interval=0.0)
    engine.add_request("a", "Hello there", SamplingParams(max_tokens=4, ignore_eos=True))
    with caplog.at_level("INFO", logger="pagellm.stats"):
        while engine.has_unfinished_requests():
            stats_logger.on_step(engine.step())
        lines = [r.getMessage() for r in caplog.records if r.name == "pagellm.stats"]
        assert lines and "generation throughput" in lines[0] and "KV cache usage" in lines[0]
        assert any("running 1" in line for line in lines)
        caplog.clear()
        stats_logger.on_step([])  # idle since the last line
        stats_logger.on_step([])
        assert not [r for r in caplog.records if r.name == "pagellm.stats"]
