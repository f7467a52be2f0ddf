"""One stage of a pipeline-parallel model: a contiguous slice of the decoder layers, run on
micro-batches whose activations travel between stages by point-to-point sends.

With `--pipeline-parallel-size P` rank `r` is stage `r // T` (T: the tensor-parallel size,
engine/worker/parallel.py). Each rank builds and loads only what its stage computes
(engine/worker/stage_layout.py): its layers; the embedding and the LM head on the first stage;
the final norm on the last. The loaders never read the other stages' tensors, and dummy weights
are seeded per parameter name, so they are the same at any P. Each stage's KV pool holds its own
layers only, under the same block ids, since every rank runs the same step with the same block
tables.

A step (`PipelineStage.run`), on every stage:

    stage 0:      embed mb1 -> layers -> send | embed mb2 -> layers -> send | ... | recv hidden of each mb
    stage i:      recv mb1 -> layers -> send  | recv mb2 -> layers -> send  | ...
    stage P-1:    recv mb1 -> layers -> norm -> send the wanted rows to stage 0 | ...

Sends are asynchronous, so stage i computes micro-batch k while stage i+1 computes k-1: with
P micro-batches the stages overlap (GPipe's fill and drain within one step). Between stages the
hidden states and the residual travel as one [2, tokens, hidden] tensor; back to stage 0 only
the normed rows whose logits (or prompt scores) are wanted. Stage 0 computes the logits: it holds
the LM head (tied to the embedding in many models) and the sampler is there.

The compiled decoder stack (engine/worker/models/decoder_stack.py) is off under pipeline
parallelism: it runs every layer and the final norm in one call, from embedded inputs with no
residual, so it cannot run a slice that takes and hands on a residual.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core.step import SeqInput
from engine.worker import parallel
from engine.worker.stage_layout import StageLayout


def micro_batches(seqs: list[SeqInput], count: int) -> list[list[SeqInput]]:
    """`seqs` cut into at most `count` contiguous, non-empty groups of about as many tokens each
    (contiguous: each keeps the step's order, prefills first). Every rank cuts a step alike."""
    count = max(1, min(count, len(seqs)))
    total = sum(len(s.token_ids) for s in seqs)
    groups: list[list[SeqInput]] = [[]]
    done = 0
    for i, s in enumerate(seqs):
        left = len(seqs) - i  # sequences not yet placed, this one included
        if groups[-1] and len(groups) < count and (done >= total * len(groups) / count
                                                   or left == count - len(groups)):
            groups.append([])
        groups[-1].append(s)
        done += len(s.token_ids)
    return groups


class PipelineStage:
    """Runs this rank's slice of the decoder on a step's micro-batches (see the module
    docstring). `prepare(seqs)` gives a micro-batch's (input ids, positions, attention metadata,
    wanted rows), as `ModelRunner._prepare` does for a step."""

    def __init__(self, model: nn.Module, layout: StageLayout, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, num_micro_batches: int):
        self.decoder = model.model
        self.layout = layout
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.num_micro_batches = num_micro_batches

    def run(self, seqs: list[SeqInput], prepare, kv_caches) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step on this stage. On stage 0: (the last-token hidden states, one row per
        sequence in step order; the prompt-scoring rows in step order), as the last stage sent
        them; elsewhere None. Raises whatever a failed send or receive raises."""
        layout = self.layout
        groups = micro_batches(seqs, self.num_micro_batches)
        prepared = [prepare(g) for g in groups]
        sends = []
        for k, (ids, positions, meta, rows) in enumerate(prepared):
            if layout.first:
                x, residual = self.decoder.embed(ids), None
            else:
                buf = torch.empty(2, len(ids), self.hidden_size, dtype=self.dtype, device=self.device)
                parallel.recv_from_stage(buf, layout.stage - 1)
                x, residual = buf[0], buf[1]
            x, residual = self._layers(x, residual, positions, meta, kv_caches, rows)
            out = (x if layout.last else torch.stack((x, residual))).to(self.dtype)
            # NOTE: kept until wait(): an asynchronous send reads its tensor after returning
            sends.append((parallel.send_to_stage(out, 0 if layout.last else layout.stage + 1), out))
        result = self._gather(groups, prepared) if layout.first else None
        for work, _ in sends:
            work.wait()
        return result

    def _layers(self, x, residual, positions, meta, kv_caches, rows):
        """This stage's layers (its KV caches in the same order); on the last stage the final
        norm too, and only `rows` kept: (hidden, residual), residual None on the last stage."""
        layout, layers = self.layout, self.decoder.layers
        cut = layout.last and len(rows) < x.shape[0]
        for j, i in enumerate(layout.layers):
            # NOTE: as LlamaModel.forward: past the last layer's attention only the wanted rows
            x, residual = layers[i](positions, x, residual, meta, kv_caches[j],
                                    rows if cut and i == layout.layers[-1] else None)
        if not layout.last:
            return x, residual
        x, _ = self.decoder.norm(x, residual)
        return (x if cut else x.index_select(0, rows)), None

    def _gather(self, groups, prepared) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: each micro-batch's wanted rows from the last stage, regrouped as one step's
        (last-token rows of every sequence, then every prompt-scoring row)."""
        last_rows, score_rows = [], []
        for g, (_, _, _, rows) in zip(groups, prepared):
            h = torch.empty(len(rows), self.hidden_size, dtype=self.dtype, device=self.device)
            parallel.recv_from_stage(h, self.layout.num_stages - 1)
            last_rows.append(h[: len(g)])
            score_rows.append(h[len(g):])
        return torch.cat(last_rows), torch.cat(score_rows)
