"""HF transformers greedy references for the equality tests: tokens and, per position, the
reference's top-k (logprob, token id), to tell a real divergence from a numerical near-tie."""

from __future__ import annotations

import torch

# NOTE: 5, not 2: a bf16 engine may pick the reference's third choice where its top three sit
# within bf16's rounding (seen on an AVX512-BF16 EPYC: gaps of 0.07 between first and third).
TOP_K = 5


def hf_greedy(hf_model, ids: list[int], new: int, k: int = TOP_K):
    """HF `generate(do_sample=False)`'s `new` tokens after `ids`, and per position its top-k
    (logprob, token id), best first."""
    with torch.inference_mode():
        x = torch.tensor([ids])
        res = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                output_logits=True, return_dict_in_generate=True,
                                pad_token_id=hf_model.config.eos_token_id)
    top = []
    for step_logits in res.logits:
        v, i = torch.log_softmax(step_logits[0].float(), -1).topk(k)
        top.append(list(zip(v.tolist(), i.tolist())))
    return res.sequences[0, len(ids):].tolist(), top
