"""`pagellm bench router`'s workload and its reading of the replicas' /metrics (no router needed)."""

from __future__ import annotations

import pytest

from pagellm.bench.router import metric, prefixes, workload
from pagellm.entrypoints.cli import build_parser


def test_workload_shares_each_system_prompt():
    system = prefixes(8, 50, seed=0)
    assert len(set(system)) == 8 and system == prefixes(8, 50, seed=0)
    prompts = workload(200, system, seed=0)
    assert len(set(prompts)) == 200  # each its own question
    owners = [next(i for i, s in enumerate(system) if p.startswith(s)) for p in prompts]
    assert set(owners) == set(range(8))


def test_metric_sums_every_series():
    text = ('# HELP x\npagellm_prefix_cache_hits_total{model_name="a"} 32.0\n'
            'pagellm_prefix_cache_hits_total{model_name="b"} 16.0\npagellm_other 5\n')
    assert metric(text, "pagellm_prefix_cache_hits_total") == 48.0
    assert metric(text, "pagellm_other") == 5.0


def test_flags():
    args = build_parser(["bench"]).parse_args(["bench", "router", "--setup", "cache_aware", "--repeats", "1"])
    assert args.setup == ["cache_aware"] and args.num_prompts == 200 and args.num_prefixes == 8
    with pytest.raises(SystemExit):
        build_parser(["bench"]).parse_args(["bench", "router", "--setup", "least_loaded"])
