"""Which part of the model a pipeline rank holds, and what stands in for the rest.

With `--pipeline-parallel-size P` stage s holds the decoder layers `parallel.stage_layers(L, P, s)`;
the first stage also holds the embedding and the LM head (tied to the embedding in many models),
the last the final norm. The model classes (engine/worker/models/llama.py) ask `StageLayout.
of_this_rank` while they are built, as the layers ask `parallel` for their tensor-parallel shard,
and build `MissingLayer` in place of every module another stage holds; the loaders read only the
tensors of the modules that were built (`StageLayout.holds` names them). Without pipeline
parallelism a rank holds everything.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from engine.worker import parallel

# the modules (our names, as in `model.named_parameters()`) of the first and of the last stage
FIRST_STAGE_MODULES = ("model.embed_tokens", "lm_head")
LAST_STAGE_MODULES = ("model.norm",)
_LAYER_PREFIX = "model.layers."


class MissingLayer(nn.Module):
    """What stands in for a module another stage holds: no weights; calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which part of the model this rank's stage computes."""

    stage: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def of_this_rank(cls, num_layers: int) -> StageLayout:
        p, s = parallel.pipeline_size(), parallel.stage()
        return cls(s, p, parallel.stage_layers(num_layers, p, s))

    def holds(self, name: str) -> bool:
        """Whether this stage holds the module or parameter `name` (ours, e.g.
        "model.layers.3.mlp.gate_up_proj.weight"); anything outside the decoder layers, the
        embedding, the LM head and the final norm (a rotary table) is on every stage."""
        if name.startswith(_LAYER_PREFIX):
            return int(name[len(_LAYER_PREFIX):].split(".", 1)[0]) in self.layers
        if _within(name, FIRST_STAGE_MODULES):
            return self.first
        if _within(name, LAST_STAGE_MODULES):
            return self.last
        return True


def _within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)
