"""Model resolution and weight loading: GGUF (cached conversion), HF directory, dummy configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.worker.models.loader import resolve_model


def test_gguf_conversion_is_cached_as_an_hf_directory(model_dir):
    path = Path(model_dir)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert resolve_model(None, quantization="none")[0] == model_dir  # second resolution reuses the cache


def test_hf_directory_is_accepted_as_is(model_dir):
    assert resolve_model(model_dir) == (str(Path(model_dir).resolve()), Path(model_dir).name)


def test_unknown_model_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="known:"):
        resolve_model("no-such-config", load_format="dummy")


def test_llama3_8b_shaped_config_builds_without_weights():
    # NOTE: dtype pinned: with `auto` a CPU with native bf16 times one product per 8B-sized weight
    # shape in fp32 and bf16 (choose_cpu_dtype: ~10 s of this test on CI, none of what it checks);
    # that probe has its own tests (tests/unit/test_linear_kernel.py).
    config = EngineArgs(model="llama-3-8b", load_format="dummy", max_model_len=1024,
                        dtype="float32").create_engine_config()
    hf = config.model.hf_config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads) == (4096, 32, 32, 8)


def test_dummy_weights_generate_from_token_ids():
    from engine.loop.llm import LLM

    llm = LLM(model="smollm2-135m", load_format="dummy", max_model_len=256, kv_cache_memory="32MiB")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.engine.block_manager.all_free()
