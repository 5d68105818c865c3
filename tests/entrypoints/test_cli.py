"""The `pagellm generate` command."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

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
    r = subprocess.run([*cmd[:-1], "serve", str(llama_path), "--shutdown-timeout", "-1"],
                       capture_output=True, text=True)
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
    assert (args.model_tag, args.max_waiting_requests, args.api_key) == ("/some/model", 7, ["k"])
    assert build_parser().parse_args(["serve", "--scheduling-policy", "sla"]).scheduling_policy == "sla"


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_imports_no_torch_and_serve_help_no_server_stack():
    # `pagellm --help` must answer at once, and `serve --help` must work on a plain install (no httpx).
    probe = ("import sys\nfrom pagellm.entrypoints.cli import main\ntry:\n    main({argv})\nexcept SystemExit:\n"
             "    pass\nprint(sorted(m for m in ('torch', 'transformers', 'fastapi', 'httpx') if m in sys.modules))")
    top = _run_python(probe.format(argv=["--help"]))
    assert "{generate,serve,run-batch,bench,plan,default-model}" in top.stdout and top.stdout.strip().endswith("[]")
    serve = _run_python(probe.format(argv=["serve", "--help"]))
    assert "--gpu-memory-utilization" in serve.stdout and serve.stdout.strip().endswith("[]")
    batch = _run_python(probe.format(argv=["run-batch", "--help"]))
    assert "--output-file" in batch.stdout and batch.stdout.strip().endswith("[]")


def _all_parsers():
    parser = build_parser()
    found = {}

    def walk(p, name):
        found[name] = p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    walk(child, f"{name} {child_name}".strip())

    walk(parser, "")
    return found


def test_every_flag_has_help_and_shows_its_default():
    parsers = _all_parsers()
    assert {"serve", "generate", "bench throughput", "bench serve", "bench memory"} <= set(parsers)
    for name, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            text = formatter._get_help_string(action) or ""
            flag = f"pagellm {name} {action.option_strings[0]}"
            assert action.help, f"{flag} has no help"
            assert "default" in text.lower(), f"{flag}'s help does not show its default: {text!r}"


@pytest.mark.parametrize("argv", [["--log-level", "DEBUG", "serve"], ["serve", "--log-level", "DEBUG"],
                                  ["bench", "throughput", "--log-level", "debug"]])
def test_log_level_goes_before_or_after_the_command(argv):
    assert build_parser(argv).parse_args(argv).log_level == "DEBUG"
    assert build_parser(["serve"]).parse_args(["serve"]).log_level == "INFO"


def test_generate_without_prompts_completes_the_examples(llama_path, capsys):
    assert main(["generate", "--model", str(llama_path), "--max-seq-len", "64", "--num-kv-blocks", "16",
                 "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "Prompt: 'The capital of France is'" in out and out.count("Completion: ") == 2


def _pagellm(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def test_version_prints_the_package_version():
    import pagellm

    r = _pagellm("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pagellm {pagellm.__version__}"


def test_default_model_prints_the_path_of_the_model_run_when_none_is_given():
    from pagellm.model.default_model import default_model_path

    r = _pagellm("default-model")
    assert r.returncode == 0 and r.stdout.strip() == str(default_model_path())
    assert "SmolLM2-135M-Instruct" in _pagellm("default-model", "--help").stdout


@pytest.mark.parametrize("argv, usage, words", [
    (["serve", "--max-logprobz=3"], "usage: pagellm serve",
     "pagellm serve: error: unrecognized arguments: --max-logprobz=3 (did you mean --max-logprobs?)"),
    (["generate", "--temprature=0.5", "Hi"], "usage: pagellm generate",
     "pagellm generate: error: unrecognized arguments: --temprature=0.5 (did you mean --temperature?)"),
    (["bench", "latency", "--new-token", "3", "--bogus"], "usage: pagellm bench latency",
     "unrecognized arguments: --bogus"),
    (["plan", "--frobnicate"], "usage: pagellm plan", "pagellm plan: error: unrecognized arguments: --frobnicate"),
    (["--frobnicate", "serve"], "usage: pagellm [-h]", "pagellm: error: unrecognized arguments: --frobnicate"),
])
def test_unknown_flags_are_reported_under_the_usage_of_their_command(argv, usage, words):
    r = _pagellm(*argv)
    assert r.returncode == 2 and r.stderr.startswith(usage) and words in r.stderr, r.stderr


def test_serve_help_names_gguf_files_and_the_embedded_default():
    text = " ".join(_pagellm("serve", "--help").stdout.split())
    assert "--model MODEL a GGUF file" in text and "SmolLM2-135M-Instruct's Q4_1 GGUF" in text
    assert "tiny default" not in text
    for flag in ("--max-logprobs", "--hf-overrides", "--override-generation-config", "--ssl-keyfile", "--root-path",
                 "--config YAML", "--optimization-level", "-O", "--enable-log-requests", "--response-role"):
        assert flag in text, flag
