"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers: the whole model, the sparse block
alone, which experts run, and both checkpoint layouts of the expert weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagellm.kernels import native
from pagellm.model import loader
from pagellm.model.default_model import build_checkpoint
from pagellm.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock
from pagellm.model.registry import model_class_for
from tests.model.family_parity import (
    assert_bfloat16_logprobs_close,
    assert_family_matches_transformers,
    family_prompts,
    transformers_greedy,
)

# initializer_range 0.2 spreads logits and router scores, so greedy picks and routes are not near ties;
# at hidden 128, 0.14 keeps activations at hidden 64's scale (larger ones make bfloat16 rounding
# alone move transformers' own logprobs past the bfloat16 check's bounds).
SHAPES: dict[str, tuple[str, dict]] = {
    "mixtral-e4": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                                   num_key_value_heads=2, initializer_range=0.2)),
    "mixtral-e8-k3-window": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3, hidden_size=128,
                                             intermediate_size=64, num_hidden_layers=3, num_key_value_heads=1,
                                             sliding_window=48, tie_word_embeddings=True, initializer_range=0.14)),
    "qwen3moe-e4-mlp-only": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                               norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
                                               num_key_value_heads=2, head_dim=32, attention_bias=True,
                                               initializer_range=0.2)),
    "qwen3moe-e8-k3-step2": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                               norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=2,
                                               hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                               initializer_range=0.14)),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def moe_path(request, tmp_path_factory):
    model_type, overrides = SHAPES[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), model_type, seed=5, **overrides)


def test_moe_greedy_matches_transformers(moe_path):
    prompts = family_prompts(seed=5)
    assert_family_matches_transformers(moe_path, prompts, transformers_greedy(moe_path, prompts))


def test_moe_bfloat16_logprobs_close(moe_path):
    # One position per sequence may have switched experts on a near tie (see the helper).
    assert_bfloat16_logprobs_close(moe_path, outliers=1)


# ------------------------------------------------------------------ the sparse block alone
def count_expert_calls(block: SparseMoeBlock) -> list[int]:
    """Per expert, how many times it runs from now on (updated in place)."""
    calls = [0] * len(block.experts)

    def hook(index: int):
        def count(*_) -> None:
            calls[index] += 1
        return count

    for i, expert in enumerate(block.experts):
        expert.register_forward_hook(hook(i))
    return calls


def dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero where not picked)."""
    weights, experts = block.route(x)  # (num_tokens, top_k) each
    out = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        w = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # (num_tokens, 1)
        out += w * expert(x)
    return out


def test_experts_without_tokens_do_not_run():
    torch.manual_seed(0)
    block = SparseMoeBlock(16, 8, num_experts=4, top_k=2, renormalize=True, float32_weights=True)
    with torch.no_grad():
        # Positive inputs: experts 1 and 3 (positive router rows) win for every token.
        block.gate.weight.copy_(torch.tensor([-1.0, 2.0, -1.0, 1.0]).unsqueeze(1).expand(4, 16))
    calls = count_expert_calls(block)
    x = torch.rand(7, 16) + 0.1
    with torch.no_grad():
        out = block(x)
    assert calls == [0, 1, 0, 1]  # one batched call per picked expert, none for the others
    with torch.no_grad():
        torch.testing.assert_close(out, dense_reference(block, x))


def test_one_token_runs_only_its_top_k_experts():
    torch.manual_seed(1)
    block = SparseMoeBlock(16, 8, num_experts=8, top_k=2, renormalize=False, float32_weights=False)
    calls = count_expert_calls(block)
    x = torch.randn(1, 16)  # a decode step of one sequence
    with torch.no_grad():
        out = block(x)
        assert [i for i, n in enumerate(calls) if n] == sorted(block.route(x)[1][0].tolist())
        assert sum(calls) == 2
        torch.testing.assert_close(out, dense_reference(block, x))


@pytest.mark.parametrize("model_type, top_k", [("mixtral", 2), ("mixtral", 3), ("qwen3_moe", 3), ("qwen3_moe", 4)])
def test_block_is_bit_identical_to_transformers(model_type, top_k, monkeypatch):
    """Routing, weights' precision and the order of the sums as transformers' default experts
    implementation, in float32 and bfloat16 (with the activation computed as transformers does)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    monkeypatch.setattr(native, "silu_and_mul", lambda gate_up: None)  # the activation is not under test
    mixtral = model_type == "mixtral"
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
                                  num_local_experts=8, num_experts=8, num_experts_per_tok=top_k,
                                  norm_topk_prob=top_k == 3)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks
    torch.manual_seed(top_k)
    theirs = (MixtralSparseMoeBlock if mixtral else Qwen3MoeSparseMoeBlock)(config)
    ours = SparseMoeBlock(32, 48, 8, top_k, renormalize=mixtral or config.norm_topk_prob, float32_weights=mixtral)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
    x = torch.randn(37, 32)
    for dtype in (torch.float32, torch.bfloat16):
        theirs.to(dtype)
        ours.to(dtype)
        with torch.no_grad():
            assert torch.equal(ours(x.to(dtype)), theirs(x.to(dtype)[None])[0])


# ------------------------------------------------------------------ checkpoint layouts
@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def layouts(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(model_type, the checkpoint save_pretrained writes, the same weights in transformers' fused
    in-memory layout)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_type = request.param
    sizes = dict(intermediate_size=48) if model_type == "mixtral" else dict(moe_intermediate_size=32)
    per_expert = build_checkpoint(tmp_path_factory.mktemp(model_type), model_type, seed=2, num_hidden_layers=1,
                                  num_local_experts=4, num_experts_per_tok=2, **sizes)
    fused = tmp_path_factory.mktemp(model_type + "-fused")
    for f in per_expert.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, fused / f.name)
    state = AutoModelForCausalLM.from_pretrained(str(per_expert)).state_dict()
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(fused / "model.safetensors"))
    return model_type, per_expert, fused


def load(folder: Path) -> torch.nn.Module:
    """The registered class for the folder's config, with the folder's weights."""
    config = loader.load_config(folder)
    model = model_class_for(config.architectures)(config, max_position=64)
    with torch.no_grad():
        model.load_weights(loader.iterate_weights(folder))
    return model


def checkpoint_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_weights_load_in_both_layouts(layouts):
    model_type, per_expert, fused = layouts
    # What this transformers writes (per expert) and keeps in memory (fused): both are real layouts.
    prefix = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    down = "w2" if model_type == "mixtral" else "down_proj"
    assert f"model.layers.0.{prefix}.experts.3.{down}.weight" in checkpoint_names(per_expert)
    assert "model.layers.0.mlp.experts.gate_up_proj" in checkpoint_names(fused)
    a, b = load(per_expert), load(fused)
    assert isinstance(a, MixtralForCausalLM if model_type == "mixtral" else Qwen3MoeForCausalLM)
    expected = dict(a.named_parameters())
    got = dict(b.named_parameters())
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_fused_experts_beyond_the_config_are_a_clear_error(layouts, tmp_path):
    import json

    _, _, fused = layouts
    folder = Path(shutil.copytree(fused, tmp_path / "fewer"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_local_experts"] = 3  # (Qwen3-MoE's num_experts is saved under this name too)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts\.3\.\w+\.weight' that \w+ does not expect"):
        load(folder)
