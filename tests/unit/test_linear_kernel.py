"""The linear layers' kernel choice (engine/models/linear_kernel.py): oneDNN over packed weights
computes what F.linear computes, packing releases the dense copies it replaces (not a tied
LM head's), the settings are validated, and `--dtype auto` on a CPU takes bf16 only where it is
native and clearly faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import linear_kernel
from engine.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not linear_kernel.onednn_supported(CPU, torch.float32), reason="this torch build has no oneDNN"
)


class Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(100, 32)
        self.qkv = QKVParallelLinear(32, 8, 4, 2, bias=True)
        self.o = RowParallelLinear(32, 32)
        self.gate_up = MergedColumnParallelLinear(32, [48, 48])
        self.down = RowParallelLinear(48, 32)
        self.head = ParallelLMHead(100, 32)
        if tied:
            self.head.weight = self.embed.weight
        torch.manual_seed(0)
        for p in self.parameters():
            p.data.normal_(std=0.2)

    def forward(self, ids):
        x = self.embed(ids)
        q = self.qkv(x)[:, :32]
        x = x + self.o(q)
        g, u = self.gate_up(x).chunk(2, dim=-1)
        x = x + self.down(F.silu(g) * u)
        return self.head.compute_logits(x)


needs_panels = pytest.mark.skipif(
    not linear_kernel.panels_supported(CPU, torch.float32), reason="the panel kernel needs AVX2 and FMA"
)
PACKED_KERNELS = [pytest.param("onednn", marks=needs_onednn), pytest.param("panels", marks=needs_panels)]


@pytest.mark.parametrize("kernel", PACKED_KERNELS)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_packed_model_computes_what_f_linear_computes(kernel, tied, rows):
    model = Tiny(tied)
    ids = torch.randint(0, 100, (rows,))
    with torch.inference_mode():
        want = model(ids)
        assert linear_kernel.pack(model, kernel) == 5
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_panels
@pytest.mark.parametrize("half", [48, 40])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gate_up_packed_in_pairs_gives_the_product_and_its_silu_mul(half, rows):
    """A gate/up layer that feeds SiLU * up is packed with its halves' panels in pairs: its
    product (the path without fused ops) is still x W^T in W's column order, and `silu_mul` is
    silu(gate) * up of it in one pass (40: halves that do not fill their last panel)."""
    layer = MergedColumnParallelLinear(32, [half, half], feeds_silu_mul=True)
    plain = MergedColumnParallelLinear(32, [half, half])
    layer.weight.data.normal_(std=0.2)
    w = layer.weight.detach().clone()
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        assert plain.silu_mul(x) is None  # a layer not marked never takes the epilogue
        linear_kernel.pack(layer, "panels")
        assert layer.packed.silu_pairs and layer.weight.numel() == 0
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        g, u = F.linear(x, w).split(half, dim=-1)
        torch.testing.assert_close(layer.silu_mul(x), F.silu(g) * u, rtol=1e-5, atol=1e-5)
        x3 = x[None].expand(2, rows, 32)
        torch.testing.assert_close(layer(x3), F.linear(x3, w), rtol=1e-5, atol=1e-5)
        linear_kernel.pack(plain, "onednn") if linear_kernel.onednn_supported(CPU, torch.float32) else None
        assert plain.silu_mul(x) is None


@pytest.mark.parametrize("kernel", PACKED_KERNELS)
def test_packing_releases_dense_weights_but_a_tied_head_keeps_the_embedding_table(kernel):
    untied, tied = Tiny(False), Tiny(True)
    linear_kernel.pack(untied, kernel)
    linear_kernel.pack(tied, kernel)
    assert all(m.weight.numel() == 0 for m in (untied.qkv, untied.o, untied.gate_up, untied.down, untied.head))
    assert tied.head.weight is tied.embed.weight and tied.embed.weight.shape == (100, 32)
    assert tied.qkv.weight.numel() == 0 and tied.qkv.bias.shape == (64,)


def test_settings_are_validated():
    model = Tiny(False)
    assert linear_kernel.choose(model, "torch", CPU, torch.float32) == ("torch", "asked for")
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        linear_kernel.choose(model, "mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="needs a CPU build"):
        linear_kernel.choose(model, "onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="'panels' needs float32 on a CPU"):
        linear_kernel.choose(model, "panels", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="'panels' needs float32 on a CPU"):
        linear_kernel.choose(model, "panels", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="only onednn and panels pack"):
        linear_kernel.pack(model, "torch")
    # a GPU never probes: auto means torch there
    assert linear_kernel.choose(model, "auto", torch.device("cuda"), torch.float32)[0] == "torch"


@needs_onednn
@needs_panels
def test_auto_times_every_kernel_at_decode_and_prefill_sizes_and_says_so():
    linear_kernel._choices.clear()
    kernel, why = linear_kernel.choose(Tiny(False), "auto", CPU, torch.float32)
    assert kernel in ("torch", "onednn", "panels")
    assert f"{linear_kernel.PROBE_ROWS} rows:" in why and f"{linear_kernel.PREFILL_PROBE_ROWS} rows:" in why
    assert all(name in why for name in ("torch", "onednn", "panels")) and "GFLOP/s" in why


@needs_panels
def test_auto_picks_the_lowest_score_over_both_sizes(monkeypatch):
    """A kernel slightly slower at decode sizes but much faster at prefill sizes wins."""
    times = {linear_kernel.PROBE_ROWS: [3.0, 1.0, 1.1], linear_kernel.PREFILL_PROBE_ROWS: [3.0, 2.0, 1.0]}
    monkeypatch.setattr(linear_kernel, "_best_times", lambda shapes, variants, repeats=3, rows=16: times[rows])
    names = {"torch": None, "onednn": None, "panels": None}
    assert linear_kernel._probe([(8, 8)], names)[0] == "panels"
    times[linear_kernel.PREFILL_PROBE_ROWS] = [3.0, 1.0, 1.05]
    assert linear_kernel._probe([(8, 8)], names)[0] == "onednn"


def test_engine_args_reject_an_unknown_kernel():
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match="linear_kernel"):
        EngineArgs(model="tiny-4kv", load_format="dummy", linear_kernel="blas").create_engine_config()


@needs_onednn
def test_probing_leaves_the_global_rng_alone():
    linear_kernel._choices.clear()
    model = Tiny(False)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    linear_kernel.choose(model, "auto", CPU, torch.float32)
    assert torch.equal(torch.rand(3), want)


def meta_model(name: str | None):
    """The model `name` (None: the default) on the meta device, as EngineArgs probes it."""
    from engine.models.llama import model_class
    from engine.models.loader import load_hf_config, resolve_model

    config = load_hf_config(resolve_model(name, "dummy")[0])
    with torch.device("meta"):
        return model_class(config)(config, 256)


def test_weight_shapes_are_the_llama_layers_and_lm_head():
    assert linear_kernel.weight_shapes(meta_model(None)) == sorted(
        [(15 * 64, 576), (576, 576), (2 * 1536, 576), (576, 1536), (49152, 576)])


@pytest.mark.parametrize("fp32_s, bf16_s, want", [(1.0, 0.5, torch.bfloat16), (1.0, 0.8, torch.float32),
                                                  (1.0, 0.7, torch.float32)])
def test_auto_dtype_takes_bf16_only_when_clearly_faster(monkeypatch, fp32_s, bf16_s, want):
    # the decision rule alone: the probe's times are given, and this CPU is said to pack bf16
    monkeypatch.setattr(linear_kernel, "onednn_supported", lambda device, dtype: True)
    monkeypatch.setattr(linear_kernel, "_best_times", lambda shapes, variants, repeats: [fp32_s, bf16_s])
    monkeypatch.setattr(linear_kernel, "_choices", {})
    dtype, why = linear_kernel.choose_cpu_dtype(Tiny(False))
    assert dtype == want
    assert "GFLOP/s" in why and f"{fp32_s / bf16_s:.1f}x" in why


def test_auto_dtype_is_float32_without_native_bf16(monkeypatch):
    monkeypatch.setattr(linear_kernel, "onednn_supported", lambda device, dtype: dtype == torch.float32)
    monkeypatch.setattr(linear_kernel, "_choices", {})
    assert linear_kernel.choose_cpu_dtype(Tiny(False))[0] == torch.float32


def test_auto_dtype_probes_this_cpu_and_engine_args_follow_it():
    """The real probe on this machine: bf16 only where oneDNN packs it; EngineArgs' auto is that
    choice on a CPU, and an explicit dtype is kept."""
    from engine.config import EngineArgs

    auto = EngineArgs(model="tiny-4kv", load_format="dummy", device="cpu").create_engine_config().model.dtype
    assert auto == linear_kernel.choose_cpu_dtype(meta_model("tiny-4kv"))[0]
    if not linear_kernel.onednn_supported(CPU, torch.bfloat16):
        assert auto == torch.float32
    pinned = EngineArgs(model="tiny-4kv", load_format="dummy", device="cpu", dtype="float32").create_engine_config()
    assert pinned.model.dtype == torch.float32
