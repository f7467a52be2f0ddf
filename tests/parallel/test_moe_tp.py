"""A mixture of experts over 2 tensor-parallel ranks (gloo on the CPU): each rank holds half of
every expert's intermediate dimension, and greedy output equals HF's on the tiny Qwen3-MoE
(sparse and dense layers) of tests/families, up to a numerical near-tie."""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.families.tiny_models import build, save
from tests.parallel.conftest import tp_llm


def test_qwen3moe_tp2_equals_hf(tmp_path):
    hf = build("qwen3moe")
    path = save(hf, tmp_path / "qwen3moe")
    hf.generation_config.eos_token_id = None  # ours ignore EOS
    prompts = [[(7 * i + j) % 500 + 3 for j in range(9 + 13 * i)] for i in range(3)]
    refs = [hf_greedy(hf, ids, 10) for ids in prompts]
    with tp_llm(model=str(path), tokenizer=str(gguf_tokenizer_dir(default_gguf_path())), dtype="float32",
                block_size=4, max_model_len=128, kv_cache_memory="4MiB", swap_space=0.01,
                tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for k, (out, (ref, top)) in enumerate(zip(outs, refs)):
        assert_matches(out.outputs[0].token_ids, ref, top, f"TP=2 prompt {k}")
