"""The parallel layers cut the right shard out of a full checkpoint tensor, checked in one process:
each rank's layer is built with `parallel.rank()` patched, the communication is done by hand
(concatenate column outputs, sum row partials and embedding shards, concatenate and trim the LM
head's vocabulary slices), and the result must equal the unsplit computation. Includes a
vocabulary that does not divide by the number of ranks (the last shard is padded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.worker import parallel
from engine.worker.models import layers

SIZES = [2, 3, 4]


def shards(monkeypatch, tp: int, build):
    """`build()` once per rank, as that rank would build it; collectives become no-ops."""
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    monkeypatch.setattr(parallel, "all_reduce", lambda t: None)
    monkeypatch.setattr(parallel, "all_gather_last_dim", lambda t: t)
    out = []
    for r in range(tp):
        monkeypatch.setattr(parallel, "rank", lambda r=r: r)
        out.append(build())
    return out


@pytest.mark.parametrize("tp", SIZES)
def test_qkv_and_row_parallel_attention_projections(monkeypatch, tp):
    torch.manual_seed(tp)
    hidden, d, heads, kv_heads = 48, 8, 12, 4 if tp != 3 else 6
    wq, wk, wv = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    wo = torch.randn(hidden, heads * d)
    x = torch.randn(5, hidden)
    qkv = shards(monkeypatch, tp, lambda: layers.QKVParallelLinear(hidden, d, heads, kv_heads))
    o = shards(monkeypatch, tp, lambda: layers.RowParallelLinear(heads * d, hidden))
    parts_q, parts_k, parts_v, partial = [], [], [], 0
    for lq, lo in zip(qkv, o):
        with torch.no_grad():
            for sid, w in zip("qkv", (wq, wk, wv)):
                lq.weight_loader(lq.weight, w, sid)
            lo.weight_loader(lo.weight, wo)
        q, k, v = lq(x).split([lq.num_heads * d, lq.num_kv_heads * d, lq.num_kv_heads * d], -1)
        parts_q.append(q), parts_k.append(k), parts_v.append(v)
        partial = partial + lo(q)  # this rank's heads through its columns of o_proj
    torch.testing.assert_close(torch.cat(parts_q, -1), x @ wq.T)
    torch.testing.assert_close(torch.cat(parts_k, -1), x @ wk.T)
    torch.testing.assert_close(torch.cat(parts_v, -1), x @ wv.T)
    torch.testing.assert_close(partial, x @ wq.T @ wo.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", SIZES)
def test_merged_gate_up_and_down(monkeypatch, tp):
    torch.manual_seed(tp)
    hidden, inter = 24, 36
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(3, hidden)
    up = shards(monkeypatch, tp, lambda: layers.MergedColumnParallelLinear(hidden, [inter, inter]))
    down = shards(monkeypatch, tp, lambda: layers.RowParallelLinear(inter, hidden))
    act = layers.SiluAndMul()
    total = 0
    for lu, ld in zip(up, down):
        with torch.no_grad():
            lu.weight_loader(lu.weight, wg, 0)
            lu.weight_loader(lu.weight, wu, 1)
            ld.weight_loader(ld.weight, wd)
        total = total + ld(act(lu(x)))
    torch.testing.assert_close(total, (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", SIZES)
@pytest.mark.parametrize("vocab", [40, 41])  # 41: the last shard is padded
def test_vocab_parallel_embedding_and_lm_head(monkeypatch, tp, vocab):
    torch.manual_seed(vocab)
    dim = 6
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 1, vocab // 2, vocab - 2, vocab - 1])
    hidden = torch.randn(4, dim)
    emb = shards(monkeypatch, tp, lambda: layers.VocabParallelEmbedding(vocab, dim))
    head = shards(monkeypatch, tp, lambda: layers.ParallelLMHead(vocab, dim))
    summed = 0
    for e, h in zip(emb, head):
        with torch.no_grad():
            e.weight_loader(e.weight, table)
            h.weight_loader(h.weight, table)
        summed = summed + e(ids)
    torch.testing.assert_close(summed, table[ids])
    # all_gather concatenates the ranks' padded slices in rank order, then trims to the vocabulary
    gathered = torch.cat([F.linear(hidden, h.weight) for h in head], -1)[..., :vocab]
    torch.testing.assert_close(gathered, hidden @ table.T)
