"""The `pagellm generate` command."""

from __future__ import annotations

import subprocess
import sys

from pagellm.config import EngineArgs
from pagellm.entrypoints.cli import build_parser, main


def test_generate_prints_completions(llama_path, capsys):
    rc = main(["generate", "--model", str(llama_path), "--max-seq-len", "64", "--num-kv-blocks", "16",
               "--temperature", "0", "--max-tokens", "5", "--n", "2", "Hello", "The capital"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("Prompt: ") == 2 and out.count("Completion: ") == 4
    assert "(5 tokens, finish_reason=length)" in out


def test_engine_flags_use_vllm_names_and_aliases():
    args = build_parser().parse_args([
        "generate", "--block-size", "8", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
        "--max-seq-len", "100", "--kv-cache-memory", "1GiB", "--num-kv-blocks", "10", "--dtype", "bfloat16",
        "--seed", "3", "--load-format", "dummy", "--device", "cpu", "--no-enable-chunked-prefill", "x",
    ])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.block_size, ea.max_num_batched_tokens, ea.max_num_seqs, ea.max_model_len) == (8, 64, 4, 100)
    assert (ea.kv_cache_memory, ea.num_kv_blocks, ea.dtype, ea.seed) == ("1GiB", 10, "bfloat16", 3)
    assert (ea.load_format, ea.device, ea.enable_chunked_prefill) == ("dummy", "cpu", False)


def test_bad_flags_exit_non_zero_with_a_message(llama_path, tmp_path):
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "generate"]
    r = subprocess.run(cmd + ["--model", str(tmp_path / "missing"), "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = subprocess.run(cmd + ["--model", str(llama_path), "--top-p", "2", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "top_p must be a number in (0, 1]" in r.stderr
    r = subprocess.run(cmd + ["--dtype", "int4", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    for flags, words in [
        (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
        (["--swap-space", "inf"], "swap_space (--swap-space) must be a finite number"),
        (["--swap-space", "nan"], "swap_space (--swap-space) must be a finite number"),
        (["--default-ttft-slo", "nan"], "default_ttft_slo (--default-ttft-slo) must be a positive, finite number"),
        (["--seed", str(2**64)], "seed (--seed) must be an integer in"),
        (["--sampling-seed", str(2**64)], "seed must be an integer in"),
    ]:
        r = subprocess.run(cmd + ["--model", str(llama_path), *flags, "x"], capture_output=True, text=True)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
    r = subprocess.run([*cmd[:-1], "--log-level", "bogus", "generate", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = subprocess.run([*cmd[:-1], "serve", str(llama_path), "--shutdown-timeout", "-1"], capture_output=True, text=True)
    assert r.returncode == 2 and "--shutdown-timeout must be a finite number of seconds >= 0" in r.stderr


def test_scheduler_and_sharing_flags():
    args = build_parser().parse_args([
        "serve", "/some/model", "--scheduler-policy", "priority", "--swap-space", "0.5", "--preemption-mode",
        "recompute", "--default-ttft-slo", "0.2", "--default-tpot-slo", "0.05", "--prefill-chunk-size", "128",
        "--no-enable-prefix-caching", "--max-waiting-requests", "7", "--api-key", "k",
    ])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.scheduling_policy, ea.swap_space, ea.preemption_mode) == ("priority", 0.5, "recompute")
    assert (ea.default_ttft_slo, ea.default_tpot_slo, ea.prefill_chunk_size) == (0.2, 0.05, 128)
    assert ea.enable_prefix_caching is False
    assert (args.model_tag, args.max_waiting_requests, args.api_key) == ("/some/model", 7, "k")
    assert build_parser().parse_args(["serve", "--scheduling-policy", "sla"]).scheduling_policy == "sla"
