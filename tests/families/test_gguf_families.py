"""GGUF files of the families beyond Llama load too: a tiny random model of the family written as
a GGUF the way convert_hf_to_gguf.py writes it (tests/engine/tiny_gguf.py): in F32 it equals HF
token for token; in Q8_0 its linear layers (a mixture of experts' experts included, one
QuantLinear per expert) stay quantized and its logits follow HF's."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from engine.worker.models.quant_linear import QuantLinear
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.engine.tiny_gguf import write_gguf
from tests.families.tiny_models import build

# family (tests/families/tiny_models.py) -> GGUF architecture name (convert_hf_to_gguf.py's;
# Mixtral is written as "llama" with experts)
GGUF_FAMILIES = {"qwen3": "qwen3", "smollm3": "smollm3", "gemma3": "gemma3", "phi3": "phi3", "phi4mini": "phi3",
                 "qwen3moe": "qwen3moe", "mixtral": "llama", "gemma2": "gemma2", "olmo2": "olmo2",
                 "granite": "granite"}
# what a family's GGUF can hold (the rest as llama.cpp fixes it, a GGUF having no field for it):
# SmolLM3's NoPE layers every 4th; Gemma 3's full-attention layers every 6th; Qwen3-MoE's layers
# all sparse (llama.cpp's qwen3moe has no dense ones), experts of a width Q8_0's 32-value blocks fit
OVERRIDES = {"smollm3": {"no_rope_layer_interval": 4, "num_hidden_layers": 4, "initializer_range": 0.1},
             "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
             "qwen3moe": {"mlp_only_layers": [], "moe_intermediate_size": 64}}
# NOTE: Q8_0's rounding of weights and activations moves the tiny Gemmas' logprobs by more than
# the others': 0.13 for Gemma 2's weights drawn at 0.1 (0.05 at 0.05), and HF's own six-layer
# Gemma 3 by 0.66 with its weights rounded to Q8_0 (three layers: 0.06). Their Q8_0 tests take
# models that rounding moves less; the F32 tests check the layer patterns
Q8_OVERRIDES = {"gemma2": {"initializer_range": 0.05},
                "gemma3": {"num_hidden_layers": 3, "layer_types": ["sliding_attention"] * 3}}
PROMPT = [5, 17, 33, 2, 250, 77, 8, 100, 9, 1, 42, 300, 11, 12, 13, 14, 15]


def assert_logprobs_follow_hf(llm: LLM, hf) -> None:
    """The top-20 logprobs of PROMPT's next token within 0.1 of HF's.

    NOTE: Q8_0's rounding of weights and activations moves these tiny random models' top
    logprobs by 0.01-0.08 (HF with the Q8_0-rounded weights moves them 0.01-0.2 too); another
    model or a layer wrong moves them by whole units."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1], -1)
    diffs = [abs(lp.logprob - want[tid].item()) for tid, lp in out.outputs[0].logprobs[0].items()]
    assert len(diffs) >= 20 and max(diffs) < 0.1, max(diffs)


@pytest.fixture(scope="module")
def tokenizer():
    return str(gguf_tokenizer_dir(default_gguf_path()))


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_gguf_of_the_family_equals_hf(tmp_path, tokenizer, family):
    hf = build(family, **OVERRIDES.get(family, {}))
    path = write_gguf(tmp_path / f"{family}.gguf", hf, GGUF_FAMILIES[family])
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ref, top = hf_greedy(hf, PROMPT, 12)
    assert_matches(out.outputs[0].token_ids, ref, top, family)


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_q8_0_gguf_of_the_family_stays_quantized(tmp_path, tokenizer, family):
    hf = build(family, **(OVERRIDES.get(family, {}) | Q8_OVERRIDES.get(family, {})))
    path = write_gguf(tmp_path / f"{family}-q8.gguf", hf, GGUF_FAMILIES[family], types={"weight": "Q8_0"})
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16)
    layer = llm.engine.executor.runner.model.model.layers[0]
    mlps = getattr(layer.mlp, "experts", [layer.mlp])
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.self_attn.o_proj, QuantLinear)
    assert all(isinstance(m.gate_up_proj, QuantLinear) and isinstance(m.down_proj, QuantLinear) for m in mlps)
    if hasattr(layer.mlp, "experts"):  # one QuantLinear per expert; the router stays dense
        assert len(mlps) == 4 and not isinstance(layer.mlp.gate, QuantLinear)
    assert_logprobs_follow_hf(llm, hf)


def test_a_phi3_longrope_gguf_equals_hf_within_its_short_range(tmp_path, tokenizer):
    """Phi-3 128k's longrope as convert_hf_to_gguf.py writes it (rope_factors_long / _short
    tensors, original context length and attention factor keys) is HF's longrope again: served
    within its short range, as an HF checkpoint's is (registry.check_config)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [4.0 + i for i in range(8)]}
    hf = build("phi3", max_position_embeddings=256, original_max_position_embeddings=64, rope_parameters=rope)
    path = write_gguf(tmp_path / "phi3-longrope.gguf", hf, "phi3")
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", kv_cache_memory="4MiB", max_num_seqs=4,
              max_num_batched_tokens=16)
    assert llm.engine.config.model.max_model_len == 64
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ref, top = hf_greedy(hf, PROMPT, 12)
    assert_matches(out.outputs[0].token_ids, ref, top, "phi3 longrope")


def test_a_mixtral_gguf_with_experts_per_tensor_stays_quantized(tmp_path, tokenizer):
    """Mixtral GGUFs of llama.cpp's older convert.py hold each expert's weights as 2-D tensors
    (blk.N.ffn_gate.E.weight ...), which llama.cpp still loads: so do we, each expert quantized."""
    hf = build("mixtral")
    path = write_gguf(tmp_path / "mixtral-split.gguf", hf, "llama", types={"weight": "Q8_0"}, split_experts=True)
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16)
    moe = llm.engine.executor.runner.model.model.layers[0].mlp
    assert all(isinstance(m.gate_up_proj, QuantLinear) and isinstance(m.down_proj, QuantLinear) for m in moe.experts)
    assert_logprobs_follow_hf(llm, hf)


def test_quantization_none_dequantizes_a_family_transformers_reads_wrong(tmp_path, tokenizer):
    """--quantization none serves a Q8_0 Mixtral GGUF (which transformers' GGUF loader would read
    as a Llama without experts) from the file itself, every layer dense: HF with the same
    Q8_0-rounded weights (the router F32, as written), token for token."""
    hf = build("mixtral")
    path = write_gguf(tmp_path / "mixtral-none.gguf", hf, "llama", types={"weight": "Q8_0"})
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16, quantization="none")
    assert llm.engine.config.model.path == str(path.resolve())
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.executor.runner.model.modules())
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ref, top = hf_greedy(hf, PROMPT, 12)
    assert_matches(out.outputs[0].token_ids, ref, top, "mixtral Q8_0, --quantization none")
