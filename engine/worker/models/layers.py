"""Building blocks of the Llama family, written so that tensor parallelism slots in.

Linear layers know their shard: a column-parallel layer holds `out / world_size` rows of the
weight, a row-parallel layer holds `in / world_size` columns and all-reduces its output. With
the default world size 1 they are plain linear layers. Each parameter carries a
`weight_loader(param, full_tensor, shard_id)` that cuts its shard out of a checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import ops
from engine.worker import parallel
from engine.worker.models.linear_kernel import PanelWeight


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) with the kernel engine/worker/models/linear_kernel.py chose for `layer`."""
    packed = layer.packed
    if packed is None:
        return F.linear(x, layer.weight, bias)
    if type(packed) is PanelWeight:
        return packed.product(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_size, self.tp_rank = parallel.world_size(), parallel.rank()
        if out_features % self.tp_size:
            raise ValueError(f"{out_features} output features do not split over {self.tp_size} ranks")
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed = None  # the weight in oneDNN's layout or a PanelWeight, when linear_kernel.pack chose it
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // self.tp_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, feeds_silu_mul: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)
        # Two equal halves whose product only feeds SiluAndMul: the panels kernel may then pack
        # them in pairs and apply SiLU * up as its epilogue (`silu_mul`).
        self.feeds_silu_mul = feeds_silu_mul and len(out_sizes) == 2 and out_sizes[0] == out_sizes[1] and not bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this layer's product in one compiled pass, or None where that
        does not apply (another kernel, or no pair packing)."""
        packed = self.packed
        if type(packed) is PanelWeight and packed.silu_pairs:
            return packed.silu_mul(x)
        return None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Shard `shard_id` of the checkpoint (e.g. 1: the whole `up_proj`), or with None the
        checkpoint's own fused tensor (all parts stacked in order, as Phi-3's `gate_up_proj`),
        split into its parts, each cut for this rank."""
        if shard_id is None:
            for i, part in enumerate(loaded.split(self.out_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        param.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads are split over ranks (KV heads must divide evenly)."""

    def __init__(self, hidden: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = parallel.world_size()
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"tensor parallel size {tp} must divide the number of attention heads ({num_heads}) "
                f"and of KV heads ({num_kv_heads})"
            )
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        """Shard "q", "k" or "v" of the checkpoint (the whole projection), or with None the
        checkpoint's own fused [q; k; v] tensor (Phi-3's `qkv_proj`), split into the three,
        each cut for this rank's heads."""
        if shard_id is None:
            # NOTE: the checkpoint's sizes are all ranks' heads; this layer holds 1/tp of them
            q_all = self.num_heads * self.tp_size * self.head_size
            kv_all = self.num_kv_heads * self.tp_size * self.head_size
            for part, sid in zip(loaded.split([q_all, kv_all, kv_all], dim=0), "qkv"):
                self.weight_loader(param, part, sid)
            return
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced, unless
    `reduce_results` is False: then each rank returns its partial sum and the caller reduces
    (a mixture of experts sums its experts' partial outputs first, then all-reduces once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.tp_size, self.tp_rank = parallel.world_size(), parallel.rank()
        if in_features % self.tp_size:
            raise ValueError(f"{in_features} input features do not split over {self.tp_size} ranks")
        if bias and not reduce_results:
            raise ValueError("a bias is added once, after the reduction: it needs reduce_results")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed = None
        self.bias = None
        if bias:  # added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[1]
        param.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self)
        if self.tp_size > 1 and self.reduce_results:
            parallel.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (no split, no communication): a layer whose every
    output each rank needs, such as a mixture of experts' router. Packed like the others by
    engine/worker/models/linear_kernel.py; quantization (a Column/RowParallelLinear's) passes it by."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packed = None
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary ranges; out-of-shard ids contribute zeros."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.tp_size, self.tp_rank = parallel.world_size(), parallel.rank()
        self.shard = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = self.tp_rank * self.shard
        self.vocab_size = vocab_size
        # NOTE: empty, not zeros: a quantized table replaces it before it is ever touched, and
        # a dense one is written whole by the loader (zero rows past the vocabulary included)
        self.weight = nn.Parameter(torch.empty(self.shard, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start : self.start + self.shard]
        param[: part.shape[0]].copy_(part)
        param[part.shape[0]:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask.unsqueeze(-1)
        parallel.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; each rank computes its slice, then they are gathered."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.packed = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self)
        if self.tp_size > 1:
            logits = parallel.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.fused = False  # the compiled one-pass op on CPU tensors (ModelRunner sets it)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x (after adding `residual` when given); returns (normed, new residual).
        NOTE: fused, x and residual are overwritten with the result and the sum: the callers pass
        tensors nothing else reads (a layer's fresh output, the running residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, compiled=self.fused)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as HF Llama), with the config's theta and
    scaling. Inverse frequencies come from transformers' own RoPE initialisers, so every scaling
    type HF supports (linear, dynamic, llama3, yarn, ...) matches it exactly.

    Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini's 0.75): only the first
    `rotary_dim = int(head_size * factor)` features of each head rotate, in rotate-half layout
    over those alone; the rest pass through (HF's apply_rotary_pos_emb). The tables are
    [max_positions, rotary_dim].
    `layer_type`: the key of a config whose `rope_parameters` are per layer type (Gemma 3's
    "sliding_attention" / "full_attention"); None: the config's one set of parameters."""

    def __init__(self, hf_config, head_size: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim(hf_config, head_size)
        inv_freq, scaling = _rope_inv_freq(hf_config, self.rotary_dim, layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))  # HF's initialisers build it on the CPU
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.shape[-1] != self.rotary_dim:
            raise ValueError(f"rotary tables of width {emb.shape[-1]} for a rotary dimension of {self.rotary_dim}")
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.fused = False

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q: [T, heads, d] and k: [T, kv_heads, d] in place (views of the qkv output);
        with partial rotary, their first `rotary_dim` features of each head only."""
        if self.rotary_dim != q.shape[-1]:
            # NOTE: views again (last dim contiguous, head and token strides kept), which both the
            # compiled op and the torch one rotate in place
            q, k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        ops.rotary_embedding(positions, q, k, self.cos, self.sin, compiled=self.fused)


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters (transformers 5's `rope_parameters`, or the older
    `rope_scaling`); {} when it has neither."""
    return getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}


def rotary_dim(hf_config, head_size: int) -> int:
    """How many features of each head rotate: int(head_size * partial_rotary_factor), as HF
    computes it (the factor from the RoPE parameters, else the config's own field, else 1)."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    return head_size if factor is None else int(head_size * factor)


def _rope_inv_freq(hf_config, dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], cos/sin scaling) for a rotary dimension of `dim`; with
    `layer_type`, from that layer type's parameters."""
    params = rope_parameters(hf_config)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hasattr(hf_config, "to_transformers"):  # a GGUF's plain config: the initialisers want HF's
        hf_config = hf_config.to_transformers()
    # NOTE: on the CPU whatever the default device: some initialisers make tensors without one,
    # and one built on the meta device (a model built without memory) has no values to read
    with torch.device("cpu"):
        kw = {} if layer_type is None else {"layer_type": layer_type}
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kw)
    return inv.float(), float(scaling)


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, compiled=self.fused)


FUSED_MODULES = (RMSNorm, RotaryEmbedding, SiluAndMul)


def use_fused_ops(model: nn.Module, enabled: bool) -> None:
    """Switch the model's elementwise layers to the compiled one-pass ops (cuda_ext/csrc/cpu/
    fused.cpp; they apply to CPU tensors only) or back to torch."""
    for m in model.modules():
        if isinstance(m, FUSED_MODULES):
            m.fused = enabled


def rms_norm_heads_(norm: RMSNorm, x: torch.Tensor) -> None:
    """Normalise each [.., dim] row of `x` (e.g. [T, heads, head_dim], a strided view of the qkv
    output) by `norm` in place: the per-head query and key norms of Qwen3, OLMo 2 and Gemma 3."""
    normed, _ = norm(x.reshape(-1, x.shape[-1]).contiguous())
    x.copy_(normed.view(x.shape))
