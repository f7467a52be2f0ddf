"""A pipeline stage builds and reads only its own part of the model (engine/worker/stage_layout.py):
its layers' parameters, the embedding and the LM head on the first stage, the final norm on the
last; the loaders never read another stage's tensors (HF safetensors, GGUF served as stored);
dummy weights are the same at any P. Each stage is built in this process, `parallel` answering
as that stage's rank would: counts of parameters, bytes and tensors read, no timing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.loop.engine_args import EngineArgs
from engine.worker import parallel
from engine.worker.models import gguf_weights, loader
from engine.worker.models.dummy_weights import load_dummy_weights
from engine.worker.models.gguf_file import GGUFFile
from engine.worker.models.quant_linear import weight_footprint
from engine.worker.models.registry import model_class
from engine.worker.stage_layout import StageLayout


def as_stage(monkeypatch, pipeline_size: int, stage: int) -> None:
    """Make `parallel` answer as a rank of `stage` (of `pipeline_size`) would."""
    monkeypatch.setattr(parallel, "pipeline_size", lambda: pipeline_size)
    monkeypatch.setattr(parallel, "stage", lambda: stage)


def model_config(**kw):
    return EngineArgs(dtype="float32", max_model_len=64, **kw).create_engine_config().model


def skeleton(mc) -> torch.nn.Module:
    return model_class(mc.hf_config)(mc.hf_config, mc.max_model_len)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ReadSpy:
    """Records the names of the tensors `loader.load_weights` reads from safetensors files."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        real = loader.safe_open
        spy = self

        class Handle:
            def __init__(self, *args, **kwargs):
                self._real = real(*args, **kwargs)

            def __enter__(self):
                self._real.__enter__()
                return self

            def __exit__(self, *exc):
                return self._real.__exit__(*exc)

            def keys(self):
                return self._real.keys()

            def get_tensor(self, name):
                spy.names.append(name)
                return self._real.get_tensor(name)

        monkeypatch.setattr(loader, "safe_open", Handle)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 3-layer Llama, LM head untied, saved as an HF safetensors directory."""
    from tests.families.tiny_models import build, save

    return str(save(build("llama"), tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("pipeline_size", [2, 3])
def test_safetensors_stage_holds_and_reads_only_its_share(tiny_llama_dir, monkeypatch, pipeline_size):
    mc = model_config(model=tiny_llama_dir)
    whole_model = skeleton(mc)
    loader.load_weights(whole_model, mc.path, "auto")
    whole = params_of(whole_model)
    checkpoint = set()
    for path in Path(tiny_llama_dir).glob("*.safetensors"):
        with loader.safe_open(str(path), "pt") as fh:
            checkpoint.update(fh.keys())
    read_by_stage, bytes_by_stage = [], []
    for s in range(pipeline_size):
        as_stage(monkeypatch, pipeline_size, s)
        layout = StageLayout.of_this_rank(mc.hf_config.num_hidden_layers)
        spy = ReadSpy(monkeypatch)
        model = skeleton(mc)
        loader.load_weights(model, mc.path, "auto")
        ours = params_of(model)
        assert set(ours) == {n for n in whole if layout.holds(n)}, f"stage {s} holds another stage's modules"
        for n, p in ours.items():
            assert torch.equal(p, whole[n]), n
        assert len(spy.names) == len(set(spy.names)), "a tensor read twice"
        assert set(spy.names) == {n for n in checkpoint if layout.holds(n)}, f"stage {s} read others' tensors"
        read_by_stage.append(set(spy.names))
        bytes_by_stage.append(nbytes(ours.values()))
        if s == 0:
            assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(ours) and "model.norm.weight" not in ours
        if s == pipeline_size - 1:
            assert "model.norm.weight" in ours and "lm_head.weight" not in ours
    # every tensor of the checkpoint read by exactly one stage; the stages' bytes add up to the model's
    assert sum(map(len, read_by_stage)) == len(set().union(*read_by_stage)) == len(checkpoint)
    assert sum(bytes_by_stage) == nbytes(whole.values())


def _stage_of_gguf_tensor(name: str, num_layers: int, pipeline_size: int) -> set[int]:
    """The stages that need GGUF tensor `name`."""
    layer = re.match(r"blk\.(\d+)\.", name)
    if layer:
        return {s for s in range(pipeline_size)
                if int(layer.group(1)) in parallel.stage_layers(num_layers, pipeline_size, s)}
    if name in ("token_embd.weight", "output.weight"):
        return {0}
    if name == "output_norm.weight":
        return {pipeline_size - 1}
    return set(range(pipeline_size))


def test_gguf_stage_keeps_and_reads_only_its_share(monkeypatch):
    """The default model (SmolLM2-135M, Q8_0 / Q4 blocks kept as stored, LM head tied) at P=2."""
    mc = model_config(model=None)
    if gguf_weights.kernels_unavailable(torch.device("cpu")):
        pytest.skip("the quantized kernels are not built here")
    num_layers, pipeline_size = mc.hf_config.num_hidden_layers, 2
    whole_bytes = sum(weight_footprint(gguf_weights.build_model(mc, torch.device("cpu")))[0].values())
    f = GGUFFile.open(mc.path)
    names = set(f.tensors)
    f.close()
    reads: list[str] = []
    for method in ("raw", "dense"):
        real = getattr(GGUFFile, method)

        def spy(self, name, *args, _real=real, **kwargs):
            reads.append(name)
            return _real(self, name, *args, **kwargs)

        monkeypatch.setattr(GGUFFile, method, spy)
    stage_bytes = []
    for s in range(pipeline_size):
        as_stage(monkeypatch, pipeline_size, s)
        reads.clear()
        model = gguf_weights.build_model(mc, torch.device("cpu"))
        wanted = {n for n in names if s in _stage_of_gguf_tensor(n, num_layers, pipeline_size)}
        assert set(reads) == wanted, f"stage {s} read {sorted(set(reads) - wanted)[:4]}, " \
                                     f"missed {sorted(wanted - set(reads))[:4]}"
        layers = parallel.stage_layers(num_layers, pipeline_size, s)
        held = {int(m.group(1)) for n, _ in model.named_parameters() if (m := re.match(r"model\.layers\.(\d+)\.", n))}
        assert held == set(layers)
        stage_bytes.append(sum(weight_footprint(model)[0].values()))
    assert sum(stage_bytes) == whole_bytes, "each tensor is on one stage"
    assert max(stage_bytes) < 0.75 * whole_bytes


def test_dummy_weights_are_the_same_at_any_pipeline_size(monkeypatch):
    mc = model_config(model="tiny-4kv", load_format="dummy")
    whole_model = skeleton(mc)
    load_dummy_weights(whole_model, mc.seed)
    whole = params_of(whole_model)
    for pipeline_size in (2, 3):
        seen = set()
        for s in range(pipeline_size):
            as_stage(monkeypatch, pipeline_size, s)
            model = skeleton(mc)
            load_dummy_weights(model, mc.seed)
            for n, p in params_of(model).items():
                assert torch.equal(p, whole[n]), f"P={pipeline_size} stage {s}: {n}"
                seen.add(n)
        assert seen == set(whole)
