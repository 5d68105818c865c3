"""`pagellm serve --data-parallel-size N`'s pieces that need no router: the core split, the replicas' and
the router's command lines, the flags' checks."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from pagellm.entrypoints.cli import build_parser, main
from pagellm.entrypoints.openai import data_parallel
from pagellm.entrypoints.openai.data_parallel import replica_argv, router_argv, split_cores
from pagellm.entrypoints.openai.launch import free_port


def test_split_cores_even_and_uneven():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([3, 0, 2, 1], 2) == [[0, 1], [2, 3]]
    assert split_cores(range(5), 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1, 2], 1) == [[0, 1, 2]]
    # More replicas than cores: one core each, shared round the cores.
    assert split_cores([4, 5], 3) == [[4], [5], [4]]
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        split_cores([0], 0)


def test_replica_argv_overrides_the_users_port_and_size():
    argv = replica_argv(["MODEL", "--port", "8000", "-dp", "2", "--max-model-len", "512"], 4321)
    args = build_parser(argv).parse_args(argv)
    assert (args.port, args.host, args.data_parallel_size, args.max_model_len) == (4321, "127.0.0.1", 1, 512)


def test_router_argv():
    argv = router_argv("0.0.0.0", 8000, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "round_robin", 9999, "key")
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--prometheus-port") + 1] == "9999"
    assert argv[argv.index("--api-key") + 1] == "key"
    if importlib.util.find_spec("vllm_router") is not None:  # the router's own parser takes them
        from vllm_router.launch_router import parse_router_args

        parsed = parse_router_args(argv)
        assert parsed.policy == "round_robin" and len(parsed.worker_urls) == 2


def test_policy_flag_and_default():
    args = build_parser(["serve"]).parse_args(["serve", "-dp", "2"])
    assert (args.data_parallel_size, args.router_policy) == (2, "cache_aware")
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--router-policy", "fastest"])


def test_missing_router_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(data_parallel.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm_router" else real(name, *a))
    assert main(["serve", "-dp", "2", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "pip install vllm-router==" in err


def test_bad_size_is_an_error(capsys):
    assert main(["serve", "-dp", "0", "--port", str(free_port())]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


def test_namespace_carries_the_command_argv(monkeypatch):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr("pagellm.entrypoints.openai.cli_args._run_data_parallel", lambda a: seen.append(a) or 0)
    assert main(["serve", "MODEL", "-dp", "2", "--port", "1234"]) == 0
    assert seen[0].command_argv == ["MODEL", "-dp", "2", "--port", "1234"]
