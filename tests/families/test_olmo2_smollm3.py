"""What OLMo 2 and SmolLM3 add beyond tests/families/test_families.py: OLMo 2's whole-projection
q/k norms under tensor parallelism (the RMS over every rank's heads), the biases their configs
may put on o_proj and the MLP, how SmolLM3's sliding-window settings are read, and that the
compiled decoder stack stays off for both."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models import decoder_stack
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from engine.worker.models.registry import check_config, model_class, sliding_window
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.families.tiny_models import VOCAB, build, save

NEW = 10


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(gguf_tokenizer_dir(default_gguf_path()))


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 30)]


def make_llm(path, tokenizer_dir, **engine_args) -> LLM:
    return LLM(model=str(path), tokenizer=tokenizer_dir, dtype="float32", block_size=4, max_model_len=64,
               kv_cache_memory="2MiB", swap_space=0.01, **engine_args)


def check_equals_hf(llm: LLM, hf, label: str) -> None:
    """The prompts batched through `llm` give HF's greedy tokens."""
    ids = prompts()
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for k, (p, out) in enumerate(zip(ids, outs)):
        ref, top = hf_greedy(hf, p, NEW)
        assert_matches(out.outputs[0].token_ids, ref, top, f"{label} prompt {k}")


@pytest.mark.timeout(60)
def test_olmo2_tp2_equals_hf(tmp_path, tokenizer_dir, monkeypatch):
    """Two ranks, one KV head and two query heads each: the q/k norms' RMS spans both ranks'
    heads (an all-reduce of each token's sums of squares), as HF's over the whole projection.
    About 10 s with the worker's start and stop (15 s on 2 cores under others' load)."""
    monkeypatch.setenv("PAGED_SERVE_TP_TIMEOUT", "30")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the worker
    hf = build("olmo2")
    llm = make_llm(save(hf, tmp_path / "olmo2"), tokenizer_dir, tensor_parallel_size=2)
    try:
        assert llm.engine.executor.weights_bytes < 0.75 * sum(p.numel() * 4 for p in hf.parameters())
        check_equals_hf(llm, hf, "olmo2 TP=2")
    finally:
        llm.engine.executor.shutdown()
    assert not dist.is_initialized()
    assert not [p for p in mp.active_children() if p.name.startswith("tp-worker")]


@pytest.mark.parametrize(("family", "biases"), [("olmo2", {"attention_bias": True}),
                                                ("smollm3", {"attention_bias": True, "mlp_bias": True}),
                                                ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_biases_on_o_proj_and_the_mlp_are_applied(tmp_path, tokenizer_dir, family, biases):
    """HF's Llama, OLMo 2 and SmolLM3 put `attention_bias` on q/k/v and o_proj, `mlp_bias` (Llama,
    SmolLM3) on gate/up/down: a checkpoint's bias the model had no parameter for would be
    skipped by the loader silently."""
    hf = build(family, **biases)
    llm = make_llm(save(hf, tmp_path / family), tokenizer_dir)
    check_equals_hf(llm, hf, f"{family} {biases}")
    layer = llm.engine.executor.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None
    assert (layer.mlp.down_proj.bias is not None) == biases.get("mlp_bias", False)


def test_smollm3_sliding_window_is_read_from_its_config():
    """Off by default (use_sliding_window False); on, the NoPE layers are "sliding_attention"
    (their attention windowed; the context is not cut); a `layer_types` of full layers only (as HF
    reads it) needs none, nor does Qwen3's window below max_window_layers."""
    default = build("smollm3").config
    assert default.sliding_window is None and sliding_window(default) is None
    assert check_config(default, 128, max_model_len_asked=True) == 128
    on = build("smollm3", use_sliding_window=True, sliding_window=24).config
    assert on.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert sliding_window(on) == 24 and check_config(on, 128, max_model_len_asked=False) == 128
    full = build("smollm3", use_sliding_window=True, sliding_window=24, layer_types=["full_attention"] * 3).config
    assert sliding_window(full) is None
    qwen3 = build("qwen3", use_sliding_window=True, sliding_window=24, max_window_layers=3).config
    assert sliding_window(qwen3) is None and check_config(qwen3, 128, max_model_len_asked=True) == 128


@pytest.mark.parametrize(("family", "arch"), [("olmo2", "Olmo2ForCausalLM"), ("smollm3", "SmolLM3ForCausalLM")])
def test_the_compiled_stack_does_not_run_them(family, arch):
    config = build(family, architectures=[arch]).config
    cls = model_class(config)
    assert cls.__module__ == f"engine.worker.models.{family}"
    assert decoder_stack.why_not(cls(config, 64), torch.device("cpu"), 1) == cls.compiled_stack_unsupported
