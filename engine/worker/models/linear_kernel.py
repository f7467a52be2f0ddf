"""Which kernel the model's linear layers multiply with on a CPU, chosen once at start-up.

Three fp32 paths:

* ``torch``: ``F.linear``, i.e. the BLAS torch was built with (MKL on x86 wheels);
* ``onednn``: oneDNN's inner product over a weight reordered once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the pair inductor's
  weight freezing emits);
* ``panels``: our AVX2/FMA kernel over a weight packed once into 16-column panels
  (``cuda_ext/csrc/cpu/linear.cpp``), written for the few-row products of decode steps.

Which one is faster depends on the CPU, not on us: on the 2-core AMD EPYC this was written on,
oneDNN over prepacked weights ran the SmolLM2-135M shapes 1.2-1.5x faster than MKL at 256 rows
and 2-4x at 2-16 rows, while MKL on Intel CPUs is often on par; on a 2-core AVX2 EPYC (Zen 3)
the panel kernel ran 1.4x oneDNN at 16 rows and 1.1-1.3x at 32-256 (all layers, weights cold),
and on AVX-512 CPUs oneDNN's wider kernels should win. So ``auto`` (the default) times them on
this model's own weight shapes at a decode-sized and a prefill-sized batch (`KernelChooser`:
interleaved repetitions, medians) and keeps the default, oneDNN (`AUTO_PREFERENCE`), unless
another is clearly faster; the choice is recorded per CPU, shapes, dtype and threads beside the
other start-up caches, so later starts reuse it without timing anything, and the log says which
it was and the rates. ``torch``, ``onednn`` and ``panels`` force one. All compute the same
product in fp32 (they differ only in summation order, ~1e-6 relative), so greedy output still
matches HF token for token either way.

``--dtype auto`` on a CPU is chosen here too (`choose_cpu_dtype`): bf16 where the CPU multiplies
it natively and it is clearly faster on the model's shapes, fp32 otherwise.

Packing replaces a layer's dense weight by the packed copy (memory is not doubled), except
for an LM head tied to the embedding, whose table the embedding lookup still reads.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import ops
from engine.core.config import cache_dir
from engine.worker.models.kernel_chooser import DEFAULT_REPEATS, KernelChooser, Workload, cpu_identity
from engine.worker.models.quant_linear import QUANT_MODULES

logger = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "onednn", "panels")
# NOTE: rows per timed product: a decode step's batch on a small CPU server, where the
# kernels differ most (and what the bf16 probe uses).
PROBE_ROWS = 16
# The kernel choice also times a prefill-sized product: a kernel that wins decodes by a little
# must not lose prompts by a lot. A challenger's speedup is the geometric mean over both sizes.
PREFILL_PROBE_ROWS = 128
# `auto`'s incumbent is the first of these that runs here; another replaces it only when clearly
# faster (kernel_chooser.DEFAULT_MARGIN). NOTE: oneDNN first: it runs fp32 and bf16 and is
# maintained by the CPU vendors; our panels next (fp32, AVX2); torch last, as it packs nothing and
# the decoder layers' one compiled call (ops.decoder_stack) needs a packed kernel, a gain the
# timing does not see. Quantized kernels join this order when they join the candidates.
AUTO_PREFERENCE = ("onednn", "panels", "torch")
# NOTE: a timed product reads a weight copy not read since it was made, as a forward pass reads
# each layer's weight once per step (from DRAM: the model is larger than the cache). Up to this
# many bytes of copies per shape (2x the 32 MiB L3 of the EPYCs measured on), at most one per
# layer of that shape and one per repetition; a larger weight is its only copy.
COLD_BYTES = 64 * 2**20
# `--dtype auto` on a CPU takes bf16 only when it is clearly faster (`choose_cpu_dtype`): a near
# tie keeps fp32's precision, and a wide margin keeps a noisy probe from choosing differently in
# two processes of one machine (the tiny test models come out at ~1.2x where SmolLM2 is ~1.8x).
BF16_MIN_SPEEDUP = 1.5
_choices: dict[tuple, tuple[str, str]] = {}  # per process: the dtype probe's shapes -> (dtype, why)


@dataclass(frozen=True)
class PanelWeight:
    """A layer's weight packed for ``ops.linear_panels`` (the ``panels`` kernel).

    With ``silu_pairs`` the weight is ``[gate | up]`` (halves of out_features / 2 rows) packed
    with the halves' 16-row groups alternating, for ``ops.linear_panels_silu_mul`` (the MLP's
    SiLU * up as the product's epilogue); :meth:`product` still gives ``x W^T`` from it."""

    panels: torch.Tensor  # [ceil(out / 16), in, 16] fp32 (silu_pairs: [2 * ceil(out / 32), in, 16])
    out_features: int
    silu_pairs: bool = False

    @classmethod
    def pack(cls, weight: torch.Tensor, silu_pairs: bool = False) -> "PanelWeight":
        if not silu_pairs:
            return cls(ops.linear_pack(weight), weight.shape[0])
        half, k = weight.shape[0] // 2, weight.shape[1]
        groups = -(-half // 16)
        padded = weight.new_zeros(2, groups * 16, k)
        padded[:, :half] = weight.view(2, half, k)
        # [2, groups, 16, k] -> [groups, 2, 16, k]: gate's group i, then up's group i.
        pairs = padded.view(2, groups, 16, k).transpose(0, 1).reshape(2 * groups * 16, k)
        return cls(ops.linear_pack(pairs), weight.shape[0], True)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias), in W's own column order."""
        if not self.silu_pairs:
            return ops.linear_panels(x, self.panels, self.out_features, bias)
        groups = self.panels.shape[0] // 2
        y = ops.linear_panels(x, self.panels, 2 * groups * 16)
        half = self.out_features // 2
        y = y.view(*x.shape[:-1], groups, 2, 16).transpose(-3, -2).reshape(*x.shape[:-1], 2, groups * 16)
        y = y[..., :half].reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T), one pass (needs ``silu_pairs``)."""
        return ops.linear_panels_silu_mul(x, self.panels, self.out_features // 2)


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here (a CPU build with oneDNN; fp32, or bf16 on CPUs
    with native bf16 support, which oneDNN itself checks when packing)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), from torch's CPU feature
    checks. NOTE: not `onednn_supported`: its probe starts oneDNN, ~20 MB of resident memory
    that a model whose linear layers are all quantized never uses otherwise."""
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def reduced_precision_is_slow(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 / fp16 on a CPU that cannot multiply in it natively (oneDNN refuses to pack it), where
    torch's matmuls convert to fp32 on the fly: measured on an AVX2 EPYC at the SmolLM2 shapes,
    bf16 F.linear ran 14-16 GFLOP/s against fp32's 40-90 (and oneDNN fp32's 68-129)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not onednn_supported(device, dtype)


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose dense `weight` multiplies activations (they carry a `packed` attribute);
    layers over quantized weights (engine/worker/models/quant_linear.py) have their own kernels."""
    return [m for m in model.modules() if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and not isinstance(m, QUANT_MODULES)]


def panels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ``panels`` kernel runs here: fp32 on a CPU, with the compiled ops built for a
    CPU with AVX2 and FMA."""
    return device.type == "cpu" and dtype == torch.float32 and ops.linear_panels_available()


def choose(model: nn.Module, setting: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(kernel, reason) for a ``--linear-kernel`` setting; raises ValueError for an unknown
    setting, or ``onednn`` / ``panels`` where it cannot run."""
    if setting not in KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(KERNELS)}; got {setting!r}")
    if setting == "torch":
        return "torch", "asked for"
    if setting == "onednn":
        if not onednn_supported(device, dtype):
            raise ValueError(f"linear_kernel 'onednn' needs a CPU build of torch with oneDNN support for {dtype}")
        return "onednn", "asked for"
    if setting == "panels":
        if not panels_supported(device, dtype):
            raise ValueError("linear_kernel 'panels' needs float32 on a CPU with AVX2 and FMA (and the compiled ops)")
        return "panels", "asked for"
    candidates = {"torch": _torch}
    if onednn_supported(device, dtype):
        candidates["onednn"] = _onednn
    if panels_supported(device, dtype):
        candidates["panels"] = _panels
    if len(candidates) == 1:
        return "torch", f"no packed linear kernel runs for {dtype} on {device.type}"
    decode, prefill = shape_counts(model), shape_counts(model, lm_head=False)
    if not decode:
        return "torch", "unused: every linear layer is quantized, with kernels of its own"
    chooser = kernel_chooser()
    with torch.inference_mode():
        choice = chooser.choose(choice_key(decode, prefill, dtype, candidates), candidates,
                                probe_workloads(decode, prefill, dtype), AUTO_PREFERENCE)
    return choice.name, choice.describe(chooser.margin)


def kernel_chooser() -> KernelChooser:
    """The chooser of `auto`, keeping its choices under the cache directory (PAGED_SERVE_CACHE,
    else ~/.cache/paged-serve) in kernel_choices/."""
    return KernelChooser("linear", cache_dir() / "kernel_choices")


def choice_key(decode: dict[tuple[int, int], int], prefill: dict[tuple[int, int], int], dtype: torch.dtype,
               candidates) -> dict:
    """What decides `auto`'s answer besides the candidates: the CPU (model and ISA flags), torch
    (its oneDNN), the compiled ops' build (the panels kernel, where it runs), the threads, the
    dtype, the shapes timed at each size with their layer counts, and the probe's sizes."""
    def shapes(counts):
        return [[n, k, c] for (n, k), c in sorted(counts.items())]

    key = {"cpu": cpu_identity(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": str(dtype).removeprefix("torch."), "rows": [PROBE_ROWS, PREFILL_PROBE_ROWS],
           "shapes": [shapes(decode), shapes(prefill)], "cold_bytes": COLD_BYTES}
    if "panels" in candidates:
        from cuda_ext import build

        # NOTE: only where panels runs: this digest changes with any edit of the compiled sources.
        key["ops_build"] = build.source_hash("cpu")
    return key


def probe_workloads(decode: dict[tuple[int, int], int], prefill: dict[tuple[int, int], int],
                    dtype: torch.dtype) -> list[Workload]:
    """One product per shape of `decode` at `PROBE_ROWS` rows and of `prefill` at
    `PREFILL_PROBE_ROWS`, each weighted by how many layers have that shape (a step's linear
    layers, not one layer per shape).

    NOTE: a prefill step runs the LM head only on its prompts' last tokens, so the prefill size
    leaves it out (timed at 128 rows it was ~90% of the probe's time and ~20% of its score)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    workloads = []
    for rows, counts in ((PROBE_ROWS, decode), (PREFILL_PROBE_ROWS, prefill)):
        for (n, k), count in sorted(counts.items()):
            copies = max(1, min(count, DEFAULT_REPEATS + 1, COLD_BYTES // (n * k * elem)))
            workloads.append(Workload(f"{rows} rows", partial(_probe_inputs, n, k, rows, copies, dtype),
                                      weight=count, flops=2.0 * rows * n * k))
    return workloads


def _probe_inputs(n: int, k: int, rows: int, copies: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    # NOTE: its own generator: probing must not move the global RNG that unseeded requests use.
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return [w] + [w.clone() for _ in range(copies - 1)], torch.randn(rows, k, generator=gen).to(dtype)


def pack(model: nn.Module, kernel: str = "onednn") -> int:
    """Switch every linear layer to `kernel` (``onednn`` or ``panels``) over a packed copy of
    its weight; returns how many."""
    if kernel not in ("onednn", "panels"):
        raise ValueError(f"only onednn and panels pack weights, not {kernel!r}")
    layers = linear_layers(model)
    for m in layers:
        w = m.weight.detach()
        if kernel == "onednn":
            m.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        else:
            m.packed = PanelWeight.pack(w, silu_pairs=getattr(m, "feeds_silu_mul", False))
        if not _is_tied(model, m):
            # NOTE: the dense copy is never read again (loading is over), so it is released.
            m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype, device=m.weight.device), requires_grad=False)
    return len(layers)


def _is_tied(model: nn.Module, layer: nn.Module) -> bool:
    """Whether `layer.weight` is also some other module's parameter (a tied LM head)."""
    return any(other is not layer and getattr(other, "weight", None) is layer.weight for other in model.modules())


def shape_counts(model: nn.Module, lm_head: bool = True) -> dict[tuple[int, int], int]:
    """How many linear layers have each (out, in) shape (only the shapes are read); without
    the LM head (the layer with `compute_logits`) unless `lm_head`."""
    return dict(Counter(tuple(m.weight.shape) for m in linear_layers(model)
                        if lm_head or not hasattr(m, "compute_logits")))


def weight_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (out, in) shapes of the model's linear layers (a model on the meta device
    will do: only the shapes are read)."""
    return sorted({tuple(m.weight.shape) for m in linear_layers(model)})


def choose_cpu_dtype(model: nn.Module) -> tuple[torch.dtype, str]:
    """(dtype, reason) for ``--dtype auto`` on a CPU: bfloat16 where this CPU multiplies it
    natively (oneDNN packs bf16 weights only on CPUs with AVX512-BF16, AMX or AVX-NE-CONVERT) and
    `model`'s linear layers run at least `BF16_MIN_SPEEDUP` times faster in it than in fp32
    (oneDNN over packed weights at `PROBE_ROWS` rows, on their shapes); float32 otherwise. Only
    the shapes are read: the model may be on the meta device (the dtype comes before weights).

    NOTE: the linear layers are most of a CPU forward pass (~60-75%), and bf16 halves the bytes
    of every weight and of the KV cache. Its outputs are not fp32's, token for token:
    ``--dtype float32`` keeps HF fp32 equality on any CPU."""
    cpu = torch.device("cpu")
    if not onednn_supported(cpu, torch.bfloat16) or not onednn_supported(cpu, torch.float32):
        return torch.float32, "this CPU has no native bf16 matmul (oneDNN does not pack bf16 here)"
    shapes = weight_shapes(model)
    key = (tuple(shapes), "dtype", torch.get_num_threads())
    if key not in _choices:
        fp32, bf16 = _best_times(shapes, {"fp32": (torch.float32, _onednn), "bf16": (torch.bfloat16, _onednn)},
                                 repeats=5)
        speedup = fp32 / max(bf16, 1e-9)
        rates = _rates(shapes, {"bf16": bf16, "fp32": fp32})
        if speedup >= BF16_MIN_SPEEDUP:
            _choices[key] = ("bf16", f"this CPU multiplies bf16 natively, {speedup:.1f}x fp32 on this model's "
                                     f"linear layers at {PROBE_ROWS} rows ({rates}); --dtype float32 for fp32")
        else:
            _choices[key] = ("fp32", f"bf16 is only {speedup:.1f}x fp32 on this model's linear layers "
                                     f"at {PROBE_ROWS} rows ({rates})")
    name, why = _choices[key]
    return (torch.bfloat16 if name == "bf16" else torch.float32), why


def _cycling(products: list) -> Callable[[], torch.Tensor]:
    """A run that calls the next of `products` each time (a fresh weight copy per timed run)."""
    turns = itertools.cycle(products)
    return lambda: next(turns)()


def _torch(inputs):
    weights, x = inputs
    return _cycling([partial(F.linear, x, w) for w in weights])


def _onednn(inputs):
    weights, x = inputs
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    return _cycling([partial(torch.ops.mkldnn._linear_pointwise, x, p, None, "none", [], "") for p in packed])


def _panels(inputs):
    weights, x = inputs
    return _cycling([partial(ops.linear_panels, x, ops.linear_pack(w), w.shape[0]) for w in weights])


def _best_times(shapes: list[tuple[int, int]], variants: dict, repeats: int = 3, rows: int = PROBE_ROWS) -> list[float]:
    """Per variant (name -> (dtype, make(([w], x)) -> run)), the summed best time (of `repeats`) of
    one product per shape at `rows` rows, the variants interleaved."""
    best = [0.0] * len(variants)
    # NOTE: its own generator: probing must not move the global RNG that unseeded requests use.
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n, k in shapes:
            w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
            runs = [make(([w.to(dtype)], x.to(dtype))) for dtype, make in variants.values()]
            times: list[list[float]] = [[] for _ in runs]
            for _ in range(repeats):
                for i, run in enumerate(runs):
                    t0 = time.perf_counter()
                    run()
                    times[i].append(time.perf_counter() - t0)
            for i in range(len(runs)):
                best[i] += min(times[i])
    return best


def _rates(shapes: list[tuple[int, int]], seconds: dict[str, float], rows: int = PROBE_ROWS) -> str:
    """'name N GFLOP/s, ...' for one product per shape at `rows` rows taking `seconds`."""
    flops = sum(2 * rows * n * k for n, k in shapes)
    return ", ".join(f"{name} {flops / max(t, 1e-9) / 1e9:.0f} GFLOP/s" for name, t in seconds.items())
