"""The CPU prefill attention kernel (cuda_ext/csrc/cpu/prefill_attention.cpp) against causal
attention in float64 over each chunk's whole context: head sizes 32/64/128, GQA groups, block
sizes 1-32, chunks of 1-60 tokens after 0-70 cached ones (the task's 24-token tiles and 6-row
tiles cut at every remainder), strided queries; bf16 tensors computed in fp32 and rounded once;
a NaN in one chunk's cache stays in that chunk; bad arguments are refused; opcheck."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops
from tests.kernels.kernel_cases import require_compiled

pytestmark = pytest.mark.skipif(
    not (ops.backend() != "reference" and ops.prefill_attention_available()),
    reason="the prefill kernel needs the compiled ops built for a CPU with AVX2 and FMA",
)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def make_case(chunks, heads, kv_heads, head_size, block_size, seed):
    """Caches with random K/V, each chunk's block table a random set of blocks; queries as a
    strided view (rows of a wider qkv matrix, as the model hands them over)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(n + c) // block_size) for n, c in chunks]
    blocks = sum(need) + 3
    kc = torch.randn(blocks, kv_heads, block_size, head_size, generator=gen)
    vc = torch.randn(blocks, kv_heads, block_size, head_size, generator=gen)
    perm = torch.randperm(blocks, generator=gen).tolist()
    width = max(need)
    tables, spans, first, taken = [], [], 0, 0
    for (n, c), used in zip(chunks, need):
        tables.append(perm[taken:taken + used] + [0] * (width - used))
        spans.append([first, n, c])
        first, taken = first + n, taken + used
    rows = first
    q = torch.randn(rows, heads + 2 * kv_heads, head_size, generator=gen)[:, :heads]
    return q, kc, vc, torch.tensor(tables, dtype=torch.int32), torch.tensor(spans, dtype=torch.int32)


def reference(q, kc, vc, tables, spans, scale):
    heads, kv_heads, block_size = q.shape[1], kc.shape[1], kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for (first, n, cached), table in zip(spans.tolist(), tables.tolist()):
        ctx = cached + n
        ids = torch.tensor([table[j // block_size] for j in range(ctx)])
        offs = torch.tensor([j % block_size for j in range(ctx)])
        k = kc[ids, :, offs].double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = vc[ids, :, offs].double().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.einsum("thd,jhd->htj", q[first:first + n].double(), k) * scale
        pos = torch.arange(cached, ctx)[:, None]
        logits = logits.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
        out[first:first + n] = torch.einsum("htj,jhd->thd", logits.softmax(-1), v)
    return out.float()


CHUNKS = [
    [(1, 0)],
    [(5, 0), (1, 3)],
    [(24, 0), (25, 0), (7, 17)],
    [(60, 0), (13, 70), (1, 1)],
]


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (8, 4, 32), (4, 1, 128), (2, 2, 16)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_matches_causal_attention(chunks, heads, kv_heads, head_size, block_size):
    q, kc, vc, tables, spans = make_case(chunks, heads, kv_heads, head_size, block_size, seed=len(chunks) + heads)
    out = torch.full(q.shape, float("nan"))
    scale = head_size**-0.5
    ops.prefill_attention(out, q, kc, vc, tables, spans, scale)
    torch.testing.assert_close(out, reference(q, kc, vc, tables, spans, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", CHUNKS[1:])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (4, 1, 128)])
def test_bf16_is_the_fp32_result_rounded(chunks, heads, kv_heads, head_size):
    """bf16 queries and caches: the fp32 kernel's result on the same (bf16-representable)
    values, rounded once to bf16; the output's other rows untouched."""
    q, kc, vc, tables, spans = make_case(chunks, heads, kv_heads, head_size, 16, seed=len(chunks))
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    scale = head_size**-0.5
    wide = torch.empty(q.shape)
    ops.prefill_attention(wide, q.float(), kc.float(), vc.float(), tables, spans, scale)
    out = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, dtype=torch.bfloat16)
    ops.prefill_attention(out[:-2], q, kc, vc, tables, spans, scale)
    assert torch.equal(out[:-2], wide.bfloat16())
    assert (out[-2:] == 7).all()
    torch.testing.assert_close(out[:-2].float(), reference(q.float(), kc, vc, tables, spans, scale),
                               rtol=1e-2, atol=1e-2)


def test_a_nan_stays_in_its_chunk():
    q, kc, vc, tables, spans = make_case([(10, 5), (12, 0)], 4, 2, 32, 16, seed=7)
    kc[tables[0, 0], 0, 2] = float("nan")  # a cached key of chunk 0 (KV head 0)
    out = torch.empty(q.shape)
    ops.prefill_attention(out, q, kc, vc, tables, spans, 0.2)
    assert out[:10, :2].isnan().all()  # query heads 0-1 of chunk 0 read it
    want = reference(q, kc, vc, tables, spans, 0.2)
    torch.testing.assert_close(out[:10, 2:], want[:10, 2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[10:], want[10:], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    q, kc, vc, tables, spans = make_case([(6, 4)], 4, 2, 32, 4, seed=1)
    out = torch.empty(q.shape)
    call = lambda **kw: ops.prefill_attention(  # noqa: E731
        kw.get("out", out), kw.get("q", q), kw.get("kc", kc), kw.get("vc", vc), kw.get("tables", tables),
        kw.get("spans", spans), 0.1)
    with pytest.raises(RuntimeError, match="query must be a float32 or bfloat16 CPU"):
        call(q=q.half())
    with pytest.raises(RuntimeError, match="caches must be .* query's dtype"):
        call(q=q.bfloat16(), out=out.bfloat16())
    with pytest.raises(RuntimeError, match="head_size 32 must match the caches' \\(16\\)"):
        call(kc=kc[..., :16].contiguous(), vc=vc[..., :16].contiguous())
    with pytest.raises(RuntimeError, match="does not fit the 6 query rows"):
        call(spans=torch.tensor([[1, 6, 4]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="chunk 0 needs 3 blocks, its table has 2"):
        call(tables=tables[:, :2].contiguous())
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="chunk 0 block 1 is"):
        call(tables=bad)
    with pytest.raises(RuntimeError, match="spans must be \\[chunks, 3\\] int32"):
        call(spans=spans.long())
    torch.library.opcheck(ops.compiled_library().prefill_attention.default, (out, q, kc, vc, tables, spans, 0.1))
