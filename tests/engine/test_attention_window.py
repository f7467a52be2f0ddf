"""Sliding-window and soft-capped attention (`PagedAttention.sliding_window` / `.logit_softcap`)
through `TorchPagedBackend`: against a dense reference built from positions (HF's mask: a query
at p sees keys at p - W < kp <= p; scores c * tanh(s / c) before the mask), for a fresh prompt, a
chunk after a cached prefix, a one-token chunk and decodes in one step, GQA, several block sizes;
both in the compiled CPU kernels (which compute windows and soft-caps) and in the torch path
(`_attend_exact`, for what the kernels do not take)."""

from __future__ import annotations

from array import array

import pytest
import torch

from engine.core.step import SeqInput
from engine.worker import attention_backend, window_attention
from engine.worker.attention import PagedAttention
from engine.worker.attention_backend import TorchPagedBackend

HEADS, KV_HEADS, D = 6, 2, 16
# (new tokens, cached tokens, prefill?)
PLAN = [(37, 0, True), (9, 21, True), (1, 30, True), (1, 29, False), (1, 5, False), (1, 12, False)]


def dense_reference(q, k, v, q_pos, scale, window, softcap):
    """One sequence: q [L, H, d] at positions q_pos, k/v [S, KvH, d] at positions 0..S-1, in float64."""
    q, k, v = q.double(), k.double().repeat_interleave(HEADS // KV_HEADS, 1), v.double().repeat_interleave(
        HEADS // KV_HEADS, 1)
    s = torch.einsum("lhd,shd->hls", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = torch.tensor(q_pos).unsqueeze(1), torch.arange(k.shape[0]).unsqueeze(0)
    seen = (kp <= qp) & ((kp > qp - window) if window is not None else True)
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hls,shd->lhd", s.softmax(-1), v)


def run_step(block_size, window, softcap, dtype=torch.float32, plan=PLAN, seed=0):
    """(the backend's output, the dense reference's) for one step of `plan` on random caches."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(n + c) // block_size) for n, c, _ in plan) + 3
    perm = torch.randperm(blocks, generator=gen).tolist()
    seqs, tables, taken = [], [], 0
    for n, cached, prefill in plan:
        used = -(-(n + cached) // block_size)
        tables.append(perm[taken:taken + used])
        seqs.append(SeqInput(list(range(n)), cached, array("i", tables[-1]), prefill))
        taken += used
    T = sum(n for n, _, _ in plan)
    meta = TorchPagedBackend(block_size, torch.device("cpu")).build_metadata(seqs)
    caches = [torch.randn(blocks, KV_HEADS, block_size, D, generator=gen).to(dtype) for _ in range(2)]
    q = torch.randn(T, HEADS, D, generator=gen).to(dtype)
    k, v = (torch.randn(T, KV_HEADS, D, generator=gen).to(dtype) for _ in range(2))
    layer = PagedAttention(HEADS, KV_HEADS, D, D**-0.5, sliding_window=window, logit_softcap=softcap)
    got = meta.backend.forward(layer, q, k, v, meta, [c.clone() for c in caches])
    want, row = [], 0
    for (n, cached, _), table in zip(plan, tables):
        # the cached prefix read slot by slot from the caches as they were, then this step's rows
        ck, cv = ([c[table[p // block_size], :, p % block_size] for p in range(cached)] for c in caches)
        ks = torch.cat([torch.stack(ck), k[row:row + n]]) if cached else k[row:row + n]
        vs = torch.cat([torch.stack(cv), v[row:row + n]]) if cached else v[row:row + n]
        want.append(dense_reference(q[row:row + n], ks, vs, list(range(cached, cached + n)), D**-0.5, window,
                                    softcap))
        row += n
    return got, torch.cat(want)


def exact_calls(monkeypatch) -> list:
    """A list that grows by one at every call of the torch path."""
    calls = []
    real = attention_backend.TorchPagedBackend._attend_exact
    monkeypatch.setattr(attention_backend.TorchPagedBackend, "_attend_exact",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    return calls


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    """Which path attends: the compiled kernels (the default on a CPU), or the torch path, forced
    as for tensors the kernels do not take."""
    if request.param == "torch":
        monkeypatch.setattr(attention_backend, "_kernels_apply", lambda window, softcap, *a: not window and not softcap)
    return request.param


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,softcap", [(8, None), (5, None), (1, None), (None, 0.5), (8, 0.5), (64, 2.0)])
def test_either_path_equals_dense_attention(block_size, window, softcap, path, monkeypatch):
    calls = exact_calls(monkeypatch)
    got, want = run_step(block_size, window, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (path == "torch" and (softcap is not None or window < 37))  # 37: the longest context


def test_long_prompts_go_in_query_chunks(monkeypatch, path):
    """Chunks of 4 query rows (each reading only the keys its window reaches) give the same."""
    monkeypatch.setattr(window_attention, "QUERY_CHUNK", 4)
    got, want = run_step(4, 7, 1.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bfloat16(path):
    got, want = run_step(4, 8, 0.5, dtype=torch.bfloat16)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_the_kernels_compute_the_window_past_it(monkeypatch):
    """Every context within the window (at most W tokens): the kernels run, and give the window's
    attention; one token past it they still run, with the window, and the plain kernels' answer
    (no window) is wrong there."""
    calls = exact_calls(monkeypatch)
    longest = max(n + c for n, c, _ in PLAN)
    got, want = run_step(4, longest, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got, want = run_step(4, longest - 1, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not calls
    without_window, _ = run_step(4, None, None)
    assert not torch.allclose(without_window.double(), want, rtol=1e-3, atol=1e-3)


def test_the_torch_path_where_the_prefill_kernel_does_not_run(monkeypatch):
    """A step with prompts the prefill kernel does not take (here: it is not built) attends in
    torch with its window and soft-cap; a step of decodes alone stays on the decode kernel."""
    monkeypatch.setattr(attention_backend.ops, "prefill_attention_available", lambda: False)
    calls = exact_calls(monkeypatch)
    got, want = run_step(4, 8, 0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert calls
    calls.clear()
    got, want = run_step(4, 8, 0.5, plan=[p for p in PLAN if not p[2]])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not calls
