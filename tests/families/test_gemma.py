"""What the greedy equality tests (test_families.py) cannot see of Gemma: the final-logit
soft-cap is monotonic, so it changes no greedy token, only the logprobs; they must equal HF's."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from tests.engine.hf_reference import hf_greedy
from tests.families.tiny_models import VOCAB, build, save


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_logprobs_equal_hf_with_the_final_logit_softcap(tmp_path, family):
    hf = build(family)
    assert hf.config.final_logit_softcapping == 5.0
    path = save(hf, tmp_path / family)
    llm = LLM(model=str(path), tokenizer=str(gguf_tokenizer_dir(default_gguf_path())), dtype="float32",
              block_size=4, max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=4)
    ids = [3 + (11 * i) % (VOCAB - 3) for i in range(40)]  # past both windows
    ref, top = hf_greedy(hf, ids, 6)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))[0]
    got = out.outputs[0]
    assert got.token_ids == ref
    for j, entry in enumerate(got.logprobs):
        for lp, tid in top[j]:
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), f"token {j}, candidate {tid}"
