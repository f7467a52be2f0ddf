"""The compiled decoder stack (cuda_ext/csrc/cpu/decoder_stack.cpp) over quant_pack's weights:
one call per step equals the same kernels called one op at a time from Python in the stack's
order (bit for bit: hidden states and the K/V written), for prompt chunks beside decodes, in
fp32 and bf16, with and without q/k/v biases and `rows`; and it computes the model of the
dequantized weights (to the activations' int8 rounding). A stack mixing quantized and panel
weights is refused."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops
from tests.kernels.kernel_cases import require_compiled

pytestmark = pytest.mark.skipif(
    not (ops.backend() == "cpu" and ops.decoder_stack_available()),
    reason="the compiled stack needs the compiled CPU ops built for a CPU with AVX2 and FMA",
)

HIDDEN, HEADS, KV_HEADS, HEAD, INTER, LAYERS, BLOCK = 256, 4, 2, 64, 512, 2, 16
EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def make_model(bias: bool, seed: int = 0):
    """Per layer: float weights (norms, qkv, o, gate|up, down), their quant_pack'ed forms (mixed
    types, as a Q4_K_M file mixes them), and the dequantized floats the packed ones hold."""
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD
    layers = []
    for _ in range(LAYERS):
        w = {"in_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
             "post_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
             "qkv": torch.randn(qkv_rows, HIDDEN, generator=gen) / HIDDEN**0.5,
             "o": torch.randn(HIDDEN, HEADS * HEAD, generator=gen) / HIDDEN**0.5,
             "gate_up": torch.randn(2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
             "down": torch.randn(HIDDEN, INTER, generator=gen) / INTER**0.5,
             "bias": 0.1 * torch.randn(qkv_rows, generator=gen) if bias else None}
        qkv_parts = [(ops.quantize_ggml(w["qkv"][: HEADS * HEAD], "q4_k"), "q4_k"),
                     (ops.quantize_ggml(w["qkv"][HEADS * HEAD:], "q6_k"), "q6_k")]
        w["packed"] = {"qkv": ops.quant_pack(qkv_parts), "o": ops.quantize_weight(w["o"], "q4_0"),
                       "gate_up": ops.quantize_weight(w["gate_up"], "q4_k"),
                       "down": ops.quantize_weight(w["down"], "q8_0")}
        w["deq"] = {k: ops.quant_dequantize(p) for k, p in w["packed"].items()}
        layers.append(w)
    final_norm = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    return layers, final_norm


def rope(max_pos: int):
    inv = 1.0 / 10000 ** (torch.arange(0, HEAD, 2).float() / HEAD)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def step_inputs():
    """Two steps: (1) prompts of 7 and 9 tokens; (2) both decode one token beside a third prompt
    of 5 tokens. Block tables are disjoint ranges of a 16-block pool."""
    tables = {0: [3, 7], 1: [1, 5], 2: [10, 2]}

    def slots(seq, positions):
        return [tables[seq][p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    def table(seqs):
        return torch.tensor([tables[s] for s in seqs], dtype=torch.int32)

    step1 = dict(positions=list(range(7)) + list(range(9)), slots=slots(0, range(7)) + slots(1, range(9)),
                 prefill_tables=table([0, 1]), prefill_spans=torch.tensor([[0, 7, 0], [7, 9, 0]], dtype=torch.int32),
                 num_prefill=16, decode_tables=None, decode_lens=None, max_decode_len=0)
    step2 = dict(positions=list(range(5)) + [7, 9], slots=slots(2, range(5)) + slots(0, [7]) + slots(1, [9]),
                 prefill_tables=table([2]), prefill_spans=torch.tensor([[0, 5, 0]], dtype=torch.int32),
                 num_prefill=5, decode_tables=table([0, 1]), decode_lens=torch.tensor([8, 10], dtype=torch.int32),
                 max_decode_len=10)
    return [step1, step2]


def python_layers(x, s, layers, final_norm, caches, cos, sin, rows, mm, silu_mm):
    """The stack's order, one op at a time (decoder_stack.cpp's loop)."""
    T, P = x.shape[0], s["num_prefill"]
    positions = torch.tensor(s["positions"])
    slots = torch.tensor(s["slots"])
    q_size, kv_size = HEADS * HEAD, KV_HEADS * HEAD
    residual = x
    h, _ = ops.rms_norm(x, layers[0]["in_norm"].to(x.dtype), EPS)
    for i, w in enumerate(layers):
        if i > 0:
            h, residual = ops.rms_norm(h, w["in_norm"].to(x.dtype), EPS, residual)
        qkv = mm(h, w, "qkv", w["bias"])
        q = qkv.narrow(1, 0, q_size).view(T, HEADS, HEAD)
        k = qkv.narrow(1, q_size, kv_size).view(T, KV_HEADS, HEAD)
        v = qkv.narrow(1, q_size + kv_size, kv_size).view(T, KV_HEADS, HEAD)
        ops.rotary_embedding(positions, q, k, cos, sin)
        kc, vc = caches[i]
        ops.reshape_and_cache(k, v, kc, vc, slots)
        attn = torch.empty(T, HEADS, HEAD, dtype=x.dtype)
        if P > 0:
            ops.prefill_attention(attn[:P], q[:P], kc, vc, s["prefill_tables"], s["prefill_spans"], HEAD**-0.5)
        if P < T:
            ops.paged_attention(attn[P:], q[P:], kc, vc, s["decode_tables"], s["decode_lens"], HEAD**-0.5,
                                s["max_decode_len"])
        a = attn.view(T, q_size)
        if i == len(layers) - 1 and rows is not None:
            a, residual = a.index_select(0, rows), residual.index_select(0, rows)
        h = mm(a, w, "o", None)
        h, residual = ops.rms_norm(h, w["post_norm"].to(x.dtype), EPS, residual)
        h = mm(silu_mm(h, w), w, "down", None)
    h, _ = ops.rms_norm(h, final_norm.to(x.dtype), EPS, residual)
    return h


def quant_mm(x, w, name, bias):
    return ops.quant_matmul(x, w["packed"][name], None if bias is None else bias.to(x.dtype))


def quant_silu(x, w):
    return ops.quant_silu_mul(x, w["packed"]["gate_up"])


def stack_call(x, s, layers, final_norm, caches, cos, sin, rows, bias):
    weights = []
    for w in layers:
        weights += [w["in_norm"].to(x.dtype), w["packed"]["qkv"], w["packed"]["o"], w["post_norm"].to(x.dtype),
                    w["packed"]["gate_up"], w["packed"]["down"]]
    return ops.decoder_stack(
        x, torch.tensor(s["positions"]), weights, [w["bias"].to(x.dtype) for w in layers] if bias else [], [],
        final_norm.to(x.dtype), cos, sin, [c[0] for c in caches], [c[1] for c in caches], torch.tensor(s["slots"]),
        s["prefill_tables"], s["prefill_spans"], s["num_prefill"], s["decode_tables"], s["decode_lens"],
        s["max_decode_len"], HEADS, KV_HEADS, INTER, HEAD**-0.5, EPS, rows)


def new_caches(dtype):
    return [(torch.zeros(16, KV_HEADS, BLOCK, HEAD, dtype=dtype), torch.zeros(16, KV_HEADS, BLOCK, HEAD, dtype=dtype))
            for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_stack_equals_the_python_layers_bit_for_bit(dtype, bias):
    layers, final_norm = make_model(bias)
    cos, sin = rope(64)
    gen = torch.Generator().manual_seed(1)
    stack_caches, py_caches = new_caches(dtype), new_caches(dtype)
    for s, rows in zip(step_inputs(), [None, torch.tensor([4, 5, 6])]):
        x = torch.randn(len(s["positions"]), HIDDEN, generator=gen).to(dtype)
        want = python_layers(x.clone(), s, layers, final_norm, py_caches, cos, sin, rows, quant_mm, quant_silu)
        got = stack_call(x.clone(), s, layers, final_norm, stack_caches, cos, sin, rows, bias)
        assert got.dtype == dtype and torch.equal(got, want)
        for (k, v), (wk, wv) in zip(stack_caches, py_caches):
            assert torch.equal(k, wk) and torch.equal(v, wv)


def test_stack_computes_the_dequantized_model():
    """Against F.linear over the dequantized weights, the same Python order: the int8 rounding of
    the activations is all that differs."""
    layers, final_norm = make_model(True, seed=2)
    cos, sin = rope(64)
    gen = torch.Generator().manual_seed(3)

    def float_mm(x, w, name, bias):
        return torch.nn.functional.linear(x, w["deq"][name], bias)

    def float_silu(x, w):
        return ops.silu_and_mul(torch.nn.functional.linear(x, w["deq"]["gate_up"]))

    stack_caches, float_caches = new_caches(torch.float32), new_caches(torch.float32)
    for s in step_inputs():
        x = torch.randn(len(s["positions"]), HIDDEN, generator=gen)
        want = python_layers(x.clone(), s, layers, final_norm, float_caches, cos, sin, None, float_mm, float_silu)
        got = stack_call(x.clone(), s, layers, final_norm, stack_caches, cos, sin, None, True)
        assert (got - want).norm() <= 0.03 * want.norm()


def test_mixed_kernels_are_refused():
    layers, final_norm = make_model(False)
    cos, sin = rope(64)
    s = step_inputs()[0]
    layers[1]["packed"]["o"] = ops.linear_pack(layers[1]["o"])  # one panels weight among quantized ones
    with pytest.raises(RuntimeError, match="layer 1 weight 2 is packed for another kernel than layer 0's qkv"):
        stack_call(torch.randn(16, HIDDEN), s, layers, final_norm, new_caches(torch.float32), cos, sin, None, False)
