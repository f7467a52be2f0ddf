"""A sparse mixture of experts (MoE) in place of a decoder layer's MLP, shared by the MoE
families (Mixtral: engine/worker/models/mixtral.py, Qwen3-MoE: qwen3_moe.py).

Per token, a router (a linear layer, the checkpoint's `gate`) scores every expert; the top-k
experts by softmax probability each run their MLP on that token and the outputs are summed,
weighted by those probabilities (renormalised to sum to 1 where the family does). Routing is
HF's own, step for step (`route`), so that the same experts are chosen from the same logits.

The experts are computed sparsely: the (token, expert) pairs are sorted by expert and each
expert runs once, on the rows routed to it; an expert nobody chose does no work. There is no
dense all-experts pass. Each expert is a `LlamaMLP` of the expert's intermediate size, so its
gate/up and down projections are the ordinary linear layers: the linear kernels pack them
(engine/worker/models/linear_kernel.py), `--quantization` quantizes them, and the checkpoint's
per-expert names (`experts.N.gate_proj` ...) load through `packed_modules` like a dense MLP's.
The router is a `ReplicatedLinear`: packed, never quantized (a rounded router picks other
experts).

Tensor parallelism shards every expert's intermediate dimension as the dense MLP's is sharded:
each rank holds 1/N of every expert's gate/up rows and down columns, routes identically (the
router is replicated and its input is the same on every rank), sums its experts' partial
outputs, and all-reduces once per layer (not once per expert).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.worker import parallel
from engine.worker.models.layers import ReplicatedLinear
from engine.worker.models.llama import LlamaMLP


def route(logits: Tensor, top_k: int, norm_topk_prob: bool, weights_dtype: torch.dtype | None
          ) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k], expert ids [T, top_k] int64) from router logits [T, E], as HF's
    MixtralTopKRouter / Qwen3MoeTopKRouter: softmax in float32, top-k of the probabilities,
    optionally renormalised to sum to 1, then cast to `weights_dtype` (None: the logits' dtype;
    Mixtral keeps float32, Qwen3-MoE casts back)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or logits.dtype), experts


class SparseMoE(nn.Module):
    """A decoder layer's MoE block: `forward(x [T, hidden]) -> [T, hidden]`, in x's dtype.

    Parameters are named as the checkpoints name them below the block: `gate.weight` (the
    router, [num_experts, hidden]) and `experts.N.gate_up_proj` / `experts.N.down_proj` (the
    loader fuses each expert's gate and up, as for a dense MLP).

    `tokens_per_expert`: None, or an int64 tensor [num_experts] that each forward adds its
    routed (token, expert) pairs to (set by whoever wants the expert load, e.g.
    benchmarks/moe_decode.py; it is never reset here)."""

    def __init__(self, config, *, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool,
                 weights_dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top-k {top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob, self.weights_dtype = norm_topk_prob, weights_dtype
        self.tp_size = parallel.world_size()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        # NOTE: partial sums per rank (reduce_results=False): one all-reduce of the block's sum
        # instead of one per expert that runs.
        self.experts = nn.ModuleList(LlamaMLP(config, intermediate_size=intermediate_size, reduce_results=False)
                                     for _ in range(num_experts))
        self.tokens_per_expert: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob, self.weights_dtype)
        flat = experts.view(-1)
        # NOTE: a stable sort keeps each expert's pairs in token order, and the index_add below
        # then adds each token's expert outputs in ascending expert order, as HF's loop does.
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.tokens_per_expert is not None:
            self.tokens_per_expert += counts.to(self.tokens_per_expert.device)
        rows = order // self.top_k  # the token of each (token, expert) pair, grouped by expert
        xs = x.index_select(0, rows)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(self.experts[e](xs[start:start + n]))
                start += n
        if not outs:  # no tokens
            return torch.zeros_like(x)
        # NOTE: weighted in the routing weights' dtype, then cast: HF multiplies a bf16 expert
        # output by Mixtral's float32 weights in float32 (Qwen3-MoE's are cast to bf16 first).
        y = torch.cat(outs) * weights.view(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))
        if self.tp_size > 1:
            parallel.all_reduce(out)
        return out
