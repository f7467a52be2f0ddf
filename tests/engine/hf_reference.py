"""HF transformers greedy references for the equality tests: tokens and, per position, the
reference's top-2 (logprob, token id), to tell a real divergence from a numerical near-tie."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, ids: list[int], new: int):
    """HF `generate(do_sample=False)`'s `new` tokens after `ids`, and per position its top-2."""
    with torch.inference_mode():
        x = torch.tensor([ids])
        res = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                output_logits=True, return_dict_in_generate=True,
                                pad_token_id=hf_model.config.eos_token_id)
    top2 = []
    for step_logits in res.logits:
        v, i = torch.log_softmax(step_logits[0].float(), -1).topk(2)
        top2.append(((v[0].item(), i[0].item()), (v[1].item(), i[1].item())))
    return res.sequences[0, len(ids):].tolist(), top2
