"""The linear layers' kernel choice (engine/worker/models/linear_kernel.py): oneDNN over packed weights
computes what F.linear computes, packing releases the dense copies it replaces (not a tied
LM head's), the settings are validated, `auto` measures the kernels on the model's shapes once
and then reuses its recorded choice (the rule itself: test_kernel_chooser.py), and `--dtype
auto` on a CPU takes bf16 only where it is native and clearly faster."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.models import linear_kernel
from engine.worker.models.kernel_chooser import KernelChooser
from engine.worker.models.layers import (
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


@pytest.fixture
def choice_cache(tmp_path, monkeypatch):
    """`auto` keeps its choices under a fresh cache directory (PAGED_SERVE_CACHE)."""
    monkeypatch.setenv("PAGED_SERVE_CACHE", str(tmp_path))
    return tmp_path / "kernel_choices"


class CountingClock:
    def __init__(self):
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return time.perf_counter()


@needs_onednn
@needs_panels
def test_auto_times_every_kernel_at_decode_and_prefill_sizes_then_reuses_its_choice(choice_cache, monkeypatch):
    """The first start measures (and says so, with the rates), the next reuses the recorded
    choice without timing anything (the clock is never read)."""
    clock = CountingClock()
    make = linear_kernel.kernel_chooser
    monkeypatch.setattr(linear_kernel, "kernel_chooser", lambda: KernelChooser("linear", make().cache_dir, clock=clock))
    kernel, why = linear_kernel.choose(Tiny(False), "auto", CPU, torch.float32)
    assert kernel in ("torch", "onednn", "panels") and why.startswith("measured: ")
    assert f"{linear_kernel.PROBE_ROWS} rows:" in why and f"{linear_kernel.PREFILL_PROBE_ROWS} rows:" in why
    assert all(name in why for name in ("torch", "onednn", "panels")) and "GFLOP/s" in why
    # 5 shapes at 16 rows, 4 at 128 (no LM head), 9 timed runs of each of 3 kernels, 2 reads each
    assert clock.reads == (5 + 4) * 9 * 3 * 2
    assert len(list(choice_cache.glob("linear-*.json"))) == 1

    again, why_again = linear_kernel.choose(Tiny(False), "auto", CPU, torch.float32)
    assert again == kernel and why_again.startswith("reused the choice measured") and clock.reads == 486
    # another model (other shapes) measures again
    linear_kernel.choose(Tiny(True).head, "auto", CPU, torch.float32)
    assert clock.reads > 486 and len(list(choice_cache.glob("linear-*.json"))) == 2


def test_the_key_holds_the_cpu_dtype_threads_and_shapes_and_the_head_is_left_out_of_prefill():
    model = meta_model(None)
    decode, prefill = linear_kernel.shape_counts(model), linear_kernel.shape_counts(model, lm_head=False)
    assert decode == {(15 * 64, 576): 30, (576, 576): 30, (2 * 1536, 576): 30, (576, 1536): 30, (49152, 576): 1}
    assert prefill == {s: c for s, c in decode.items() if s != (49152, 576)}
    key = linear_kernel.choice_key(decode, prefill, torch.float32, {"torch": None, "onednn": None})
    assert key["cpu"]["model"] and key["cpu"]["isa"] is not None and key["dtype"] == "float32"
    assert key["threads"] == torch.get_num_threads() and [49152, 576, 1] in key["shapes"][0]
    assert "ops_build" not in key  # only where panels is a candidate
    assert linear_kernel.choice_key(decode, prefill, torch.bfloat16, {"torch": None})["dtype"] == "bfloat16"


def test_the_probe_weights_each_shape_by_its_layers_and_rotates_bounded_weight_copies():
    decode, prefill = {(576, 576): 30, (49152, 576): 1}, {(576, 576): 30}
    loads = linear_kernel.probe_workloads(decode, prefill, torch.float32)
    assert [(w.group, w.weight) for w in loads] == [("16 rows", 30), ("16 rows", 1), ("128 rows", 30)]
    assert loads[0].flops == 2 * 16 * 576 * 576
    weights, x = loads[0].make_inputs()
    assert len(weights) == 10 and x.shape == (16, 576)  # a fresh copy for the warm-up and each of 9 runs
    assert len(loads[1].make_inputs()[0]) == 1  # 113 MB: already more than any cache, one copy
    big = linear_kernel.probe_workloads({(4096, 4096): 32}, {}, torch.float32)[0]
    assert len(big.make_inputs()[0]) == 1  # 64 MiB each: COLD_BYTES bounds the copies
    run = linear_kernel._torch(([torch.eye(4), 2 * torch.eye(4)], torch.ones(1, 4)))
    assert [run().sum().item() for _ in range(3)] == [4.0, 8.0, 4.0]  # the copies in turn


def test_engine_args_reject_an_unknown_kernel():
    from engine.loop.engine_args import EngineArgs

    with pytest.raises(ValueError, match="linear_kernel"):
        EngineArgs(model="tiny-4kv", load_format="dummy", linear_kernel="blas").create_engine_config()


@needs_onednn
def test_probing_leaves_the_global_rng_alone(choice_cache):
    model = Tiny(False)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    linear_kernel.choose(model, "auto", CPU, torch.float32)
    assert torch.equal(torch.rand(3), want)


def meta_model(name: str | None):
    """The model `name` (None: the default) on the meta device, as EngineArgs probes it."""
    from engine.worker.models.registry import model_class
    from engine.worker.models.loader import load_hf_config, resolve_model

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
    from engine.loop.engine_args import EngineArgs

    auto = EngineArgs(model="tiny-4kv", load_format="dummy", device="cpu").create_engine_config().model.dtype
    assert auto == linear_kernel.choose_cpu_dtype(meta_model("tiny-4kv"))[0]
    if not linear_kernel.onednn_supported(CPU, torch.bfloat16):
        assert auto == torch.float32
    pinned = EngineArgs(model="tiny-4kv", load_format="dummy", device="cpu", dtype="float32").create_engine_config()
    assert pinned.model.dtype == torch.float32
