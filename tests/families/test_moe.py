"""The mixture-of-experts layer (engine/worker/models/moe.py) against HF's sparse MoE blocks of
the same weights, its sparsity (each expert computes exactly the rows routed to it), Qwen3-MoE's
choice of sparse and dense layers, and the configs start-up refuses."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.worker.models.mixtral import MixtralSparseMoE
from engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoE, is_sparse_layer
from engine.worker.models.registry import UnsupportedModelError, check_config
from tests.families.tiny_models import build

HIDDEN, EXPERTS, TOP_K = 64, 4, 2

# name -> (config class, HF block class, our block class, config overrides)
BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock", MixtralSparseMoE,
                {"num_local_experts": EXPERTS, "intermediate_size": 96}),
    "qwen3moe-norm": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", Qwen3MoeSparseMoE,
                      {"num_experts": EXPERTS, "moe_intermediate_size": 48, "norm_topk_prob": True}),
    "qwen3moe-raw": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", Qwen3MoeSparseMoE,
                     {"num_experts": EXPERTS, "moe_intermediate_size": 48, "norm_topk_prob": False}),
}


def blocks(name: str, dtype: torch.dtype = torch.float32):
    """(HF's block, ours) with the same random weights, in `dtype`."""
    config_cls, hf_path, ours_cls, kw = BLOCKS[name]
    config = getattr(transformers, config_cls)(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, **kw)
    config._experts_implementation = "eager"  # HF's reference loop over the experts hit
    module, cls = hf_path.rsplit(".", 1)
    torch.manual_seed(0)
    hf = getattr(__import__(f"transformers.models.{module}", fromlist=[cls]), cls)(config).eval()
    ours = ours_cls(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)  # a router with clear preferences
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])  # [gate; up], as ours
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
    return hf.to(dtype), ours.to(dtype)


def hf_routing(hf, x: torch.Tensor) -> torch.Tensor:
    """The expert ids [T, top_k] HF's router picks for x [T, hidden]."""
    return hf.gate(x)[2]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_moe_layer_equals_hf_block_fp32(name):
    hf, ours = blocks(name)
    x = torch.randn(3, 41, HIDDEN)
    with torch.no_grad():
        want = hf(x).reshape(-1, HIDDEN)
        got = ours(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe-norm"])
def test_moe_layer_equals_hf_block_bf16_with_each_familys_weight_dtype(name):
    """In bf16 the routing weights' dtype shows: Mixtral weighs expert outputs by float32
    weights, Qwen3-MoE by weights cast to bf16. Ours equal HF's bit for bit; the other
    family's rule would not."""
    hf, ours = blocks(name, torch.bfloat16)
    x = torch.randn(3, 41, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        want = hf(x).reshape(-1, HIDDEN)
        got = ours(x.reshape(-1, HIDDEN))
        ours.weights_dtype = None if ours.weights_dtype is torch.float32 else torch.float32
        other = ours(x.reshape(-1, HIDDEN))
    assert torch.equal(got, want)
    assert not torch.equal(other, want)


def test_each_expert_computes_exactly_the_rows_routed_to_it():
    """No dense pass: over a forward, expert e's MLP sees as many rows as tokens chose e (the
    top-k of HF's router), an expert nobody chose is never called, and the rows add up to
    tokens x top_k. `tokens_per_expert` counts the same."""
    hf, ours = blocks("qwen3moe-norm")
    x = torch.randn(5, HIDDEN)  # 10 (token, expert) pairs over 4 experts: some experts idle
    x[:] = x[0]  # every token the same: the same 2 experts chosen by all, the other 2 idle
    computed = [0] * EXPERTS
    for e, expert in enumerate(ours.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: computed.__setitem__(e, computed[e] + args[0].shape[0]))
    ours.tokens_per_expert = torch.zeros(EXPERTS, dtype=torch.int64)
    with torch.no_grad():
        ours(x)
        routed = torch.bincount(hf_routing(hf, x).view(-1), minlength=EXPERTS).tolist()
    assert computed == routed and sum(computed) == 5 * TOP_K
    assert sorted(computed) == [0, 0, 5, 5]
    assert ours.tokens_per_expert.tolist() == routed

    computed[:] = [0] * EXPERTS
    y = torch.randn(64, HIDDEN)
    with torch.no_grad():
        ours(y)
        routed = torch.bincount(hf_routing(hf, y).view(-1), minlength=EXPERTS).tolist()
    assert computed == routed and sum(computed) == 64 * TOP_K


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_shards_sum_to_the_whole_block(monkeypatch, tp):
    """Each rank holds 1/tp of every expert's intermediate dimension (cut by the layers' own
    weight loaders from the full tensors) and routes alike; its partial outputs, summed as the
    block's one all-reduce sums them, equal the unsplit block."""
    from engine.worker import parallel

    hf, whole = blocks("qwen3moe-norm")
    x = torch.randn(33, HIDDEN)
    with torch.no_grad():
        want = whole(x)
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    monkeypatch.setattr(parallel, "all_reduce", lambda t: None)  # the test sums the partials
    total = 0
    for r in range(tp):
        monkeypatch.setattr(parallel, "rank", lambda r=r: r)
        part = Qwen3MoeSparseMoE(hf.experts.config)
        with torch.no_grad():
            part.gate.weight.copy_(whole.gate.weight)
            for mine, full in zip(part.experts, whole.experts):
                gate, up = full.gate_up_proj.weight.chunk(2)
                mine.gate_up_proj.weight_loader(mine.gate_up_proj.weight, gate, 0)
                mine.gate_up_proj.weight_loader(mine.gate_up_proj.weight, up, 1)
                mine.down_proj.weight_loader(mine.down_proj.weight, full.down_proj.weight)
            assert part.experts[0].down_proj.weight.shape == (HIDDEN, 48 // tp)
            total = total + part(x)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step, mlp_only", [(1, []), (2, []), (1, [0, 2]), (2, [1]), (3, [])])
def test_qwen3moe_sparse_and_dense_layers_are_hfs(step, mlp_only):
    """`decoder_sparse_step` and `mlp_only_layers` pick the same layers as HF's."""
    hf = build("qwen3moe", num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    want = ["SparseMoeBlock" in type(layer.mlp).__name__ for layer in hf.model.layers]
    with torch.device("meta"):
        ours = Qwen3MoeForCausalLM(hf.config, 64)
    assert [isinstance(layer.mlp, Qwen3MoeSparseMoE) for layer in ours.model.layers] == want
    assert [is_sparse_layer(hf.config, i) for i in range(4)] == want


@pytest.mark.parametrize("family, field, value, message", [
    ("mixtral", "num_local_experts", 0, "num_local_experts 0 of MixtralForCausalLM: a mixture of experts needs at "
                                        "least one expert"),
    ("qwen3moe", "num_experts", 0, "num_experts 0 of Qwen3MoeForCausalLM: a mixture of experts needs at least one "
                                   "expert"),
    ("mixtral", "num_experts_per_tok", 5, r"num_experts_per_tok 5 of MixtralForCausalLM must be between 1 and "
                                          r"num_local_experts \(4\)"),
    ("qwen3moe", "num_experts_per_tok", 0, r"num_experts_per_tok 0 of Qwen3MoeForCausalLM must be between 1 and "
                                           r"num_experts \(4\)"),
])
def test_configs_without_experts_or_with_too_many_per_token_are_refused(family, field, value, message):
    hf = build(family, num_hidden_layers=1)
    config = hf.config
    config.architectures = [type(hf).__name__]  # as save_pretrained writes it
    assert check_config(config, 128, max_model_len_asked=False) == 128
    setattr(config, field, value)
    with pytest.raises(UnsupportedModelError, match=f"^{message}$"):
        check_config(config, 128, max_model_len_asked=False)
