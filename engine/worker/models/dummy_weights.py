"""Random ("dummy") weights that do not depend on how the model is split: the same values at
any tensor-parallel size and on any pipeline stage.

Every parameter's full (unsharded) tensor is drawn from a generator seeded by the run's seed and
the parameter's name, then its `weight_loader` cuts this rank's shard out of it. Seeded per name,
a pipeline stage draws its own parameters only (the model holds no others:
engine/worker/stage_layout.py) and gets the values one process draws for them.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from engine.worker.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

logger = logging.getLogger(__name__)


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` (ours, e.g. "model.layers.3.mlp.down_proj.weight")."""
    # NOTE: hashlib, not hash(): Python salts str hashes per process, and every rank must agree
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def load_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill `model`'s parameters (a tied one once, under its first name) with uniform values in
    [-0.05, 0.05), each drawn whole in float32 from its own seeded generator (module docstring)."""
    t0 = time.perf_counter()
    # NOTE: drawn where the model lives: a CPU generator takes ~40 s for an 8B model's values,
    # a GPU's a fraction of a second.
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        module = owner[id(p)]
        full = torch.empty(_full_shape(module, p), dtype=torch.float32, device=device)
        full.uniform_(-0.05, 0.05, generator=gen.manual_seed(parameter_seed(seed, name)))
        for shard_id, part in _checkpoint_parts(module, full):
            loader = getattr(p, "weight_loader", None)
            if loader is not None:
                loader(p, part.to(p.dtype), shard_id)
            else:
                p.copy_(part)
    logger.info("initialised dummy weights in %.1f s", time.perf_counter() - t0)


def _full_shape(module: torch.nn.Module, p: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape `p` has at world size 1."""
    tp = getattr(module, "tp_size", 1)
    if isinstance(module, VocabParallelEmbedding):
        return (module.vocab_size, p.shape[1])
    if isinstance(module, ColumnParallelLinear):
        return (p.shape[0] * tp,) + tuple(p.shape[1:])
    if isinstance(module, RowParallelLinear) and p is module.weight:
        return (p.shape[0], p.shape[1] * tp)
    return tuple(p.shape)


def _checkpoint_parts(module: torch.nn.Module, full: torch.Tensor):
    """(shard id, tensor) pairs as a checkpoint would hand them to the weight loader."""
    if isinstance(module, QKVParallelLinear):
        q = module.num_heads * module.tp_size * module.head_size
        kv = module.num_kv_heads * module.tp_size * module.head_size
        return list(zip("qkv", full.split([q, kv, kv])))
    if isinstance(module, MergedColumnParallelLinear):
        return list(enumerate(full.split(module.out_sizes)))
    return [(None, full)]
