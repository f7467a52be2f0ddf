"""Offline throughput: the same prompts through paged-serve's engine and through HF transformers'
batched `generate` (left padding, same max_tokens, greedy), in one process.

    python -m benchmarks.offline_throughput --num-prompts 64 --max-tokens 64

Prints output tokens/s for both and their ratio (engine / HF). Both generate exactly
max_tokens per prompt (EOS ignored), so the token counts are equal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.workload import sample_lengths
from engine import LLM, SamplingParams
from tests.engine.prompts import prompt_of_length


def make_prompts(tokenizer, n: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = sample_lengths(n, rng, max_len=max_len)
    return [prompt_of_length(tokenizer, max(4, int(L)), rng.randrange(300)) for L in lengths]


def run_engine(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return dt


def run_hf(model, prompts, max_tokens: int, batch_size: int, pad_id: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, p in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
            assert out.shape[1] - width == max_tokens
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    llm = LLM(max_model_len=2048, kv_cache_memory="2GiB")
    from transformers import AutoModelForCausalLM

    from engine.worker.models.loader import convert_gguf, is_gguf

    path = llm.engine.model_config.path
    # NOTE: a GGUF (the default model, served as stored) is read by HF as the same file dequantized
    hf_path = convert_gguf(Path(path)) if is_gguf(path) else path
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    prompts = make_prompts(llm.tokenizer, args.num_prompts, args.max_prompt_len, args.seed)
    n_out = args.num_prompts * args.max_tokens
    run_engine(llm, prompts[:2], 4)  # warm-up (kernel load, allocator)
    eng, ref = [], []
    for _ in range(args.repeats):
        eng.append(n_out / run_engine(llm, prompts, args.max_tokens))
        ref.append(n_out / run_hf(hf, prompts, args.max_tokens, args.hf_batch_size, hf.config.eos_token_id))
    result = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
        "threads": torch.get_num_threads(),
        "engine_tokens_per_s": statistics.median(eng),
        "hf_tokens_per_s": statistics.median(ref),
    }
    result["ratio"] = result["engine_tokens_per_s"] / result["hf_tokens_per_s"]
    print(f"prompts: {args.num_prompts} (mean {result['mean_prompt_tokens']:.0f} tokens), "
          f"{args.max_tokens} new tokens each, {result['threads']} threads, median of {args.repeats}")
    print(f"paged-serve engine : {result['engine_tokens_per_s']:8.1f} output tokens/s")
    print(f"HF generate (pad)  : {result['hf_tokens_per_s']:8.1f} output tokens/s")
    print(f"ratio              : {result['ratio']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
