"""Phi-3 and Granite beyond test_families.py's greedy tokens: Phi-3's fused checkpoint tensors cut
into tensor-parallel shards (each rank built in this process, then two real ranks against HF),
longrope served within its short range (equal to HF there, refused past it), Granite's logits
scaling (which greedy tokens cannot see: argmax ignores a positive scale), and the config
fields refused."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir, load_weights
from engine.worker.models.phi3 import Phi3ForCausalLM
from engine.worker.models.registry import UnsupportedModelError, check_config
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.families.tiny_models import build, save
from tests.parallel.conftest import tp_env, tp_llm  # noqa: F401 (tp_env: a fixture used below)
from tests.parallel.test_layer_shards import shards

PROMPTS = [[5 + 7 * i for i in range(n)] for n in (3, 17, 30)]
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [4.0 + i for i in range(8)]}


@pytest.fixture(scope="module")
def tokenizer():
    return str(gguf_tokenizer_dir(default_gguf_path()))


def engine(path, tokenizer, **kw) -> LLM:
    args = dict(model=str(path), tokenizer=tokenizer, dtype="float32", block_size=4, kv_cache_memory="4MiB",
                max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    return LLM(**(args | kw))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_fused_checkpoint_tensors_load_into_each_ranks_shard(monkeypatch, tmp_path, tp):
    """Each rank's fused q/k/v holds its heads of q, of k and of v, and its gate/up its rows of
    gate and of up, cut from the checkpoint's [q; k; v] and [gate; up] (4 heads, 4 KV heads)."""
    hf = build("phi3", num_key_value_heads=4)
    path = save(hf, tmp_path / "phi3")
    ranks = shards(monkeypatch, tp, lambda: Phi3ForCausalLM(hf.config, 64))
    for model in ranks:
        load_weights(model, str(path), "auto")
    c, d = hf.config, 16
    for i in range(c.num_hidden_layers):
        qkv = hf.model.layers[i].self_attn.qkv_proj.weight
        q, k, v = qkv.split([c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d])
        gate, up = hf.model.layers[i].mlp.gate_up_proj.weight.chunk(2)
        for r, model in enumerate(ranks):
            layer = model.model.layers[i]
            want = torch.cat([t.chunk(tp)[r] for t in (q, k, v)])
            torch.testing.assert_close(layer.self_attn.qkv_proj.weight, want, rtol=0, atol=0)
            torch.testing.assert_close(layer.mlp.gate_up_proj.weight, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]),
                                       rtol=0, atol=0)


@pytest.mark.usefixtures("tp_env")
def test_phi4mini_on_two_ranks_equals_hf(tmp_path, tokenizer):
    """Fused checkpoint tensors, partial rotary and a tied LM head over two real ranks (gloo)."""
    hf = build("phi4mini")
    path = save(hf, tmp_path / "phi4mini")
    with tp_llm(model=str(path), tokenizer=tokenizer, dtype="float32", block_size=4, kv_cache_memory="4MiB",
                max_model_len=64, tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, greedy(10))
    for ids, out in zip(PROMPTS, outs):
        ref, top = hf_greedy(hf, ids, 10)
        assert_matches(out.outputs[0].token_ids, ref, top, f"{len(ids)}-token prompt")


def test_longrope_is_served_within_its_short_range_and_equals_hf(tmp_path, tokenizer):
    """HF rotates with the short factors (and longrope's attention factor) while a sequence is
    within original_max_position_embeddings: the default context is cut to it, and every
    sequence there equals HF's; a longer --max-model-len is refused naming the field."""
    hf = build("phi3", max_position_embeddings=256, original_max_position_embeddings=64, rope_parameters=dict(LONGROPE))
    path = save(hf, tmp_path / "phi3-longrope")
    hf.generation_config.eos_token_id = None  # HF generates on past EOS, as ignore_eos does, to the end
    with pytest.raises(UnsupportedModelError, match="max_model_len 128 exceeds the model's "
                       "original_max_position_embeddings 64: Phi3ForCausalLM's rope_type 'longrope'"):
        engine(path, tokenizer, max_model_len=128)
    llm = engine(path, tokenizer, max_model_len=None)
    assert llm.engine.config.model.max_model_len == 64
    for ids in PROMPTS:
        out = llm.generate([ids], greedy(64 - len(ids)))[0]
        ref, top = hf_greedy(hf, ids, 64 - len(ids))
        assert_matches(out.outputs[0].token_ids, ref, top, f"{len(ids)}-token prompt")


def test_granite_logprobs_equal_hf_with_its_logits_scaling(tmp_path, tokenizer):
    """Each generated token's logprob is HF's: log_softmax of the logits divided by
    logits_scaling (3 in the tiny config)."""
    hf = build("granite")
    path = save(hf, tmp_path / "granite")
    llm = engine(path, tokenizer)
    for ids in PROMPTS:
        out = llm.generate([ids], greedy(8, logprobs=1))[0].outputs[0]
        ref, top = hf_greedy(hf, ids, 8)
        assert out.token_ids == ref, f"{len(ids)}-token prompt"
        ours = [entry[tid].logprob for entry, tid in zip(out.logprobs, out.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor([t[0][0] for t in top]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_granite_biases_are_refused_naming_the_field(field):
    config = build("granite").config
    config.architectures = ["GraniteForCausalLM"]  # what a saved checkpoint's config says
    setattr(config, field, True)
    with pytest.raises(UnsupportedModelError, match=f"^{field} of GraniteForCausalLM is not served"):
        check_config(config, 64, max_model_len_asked=False)
