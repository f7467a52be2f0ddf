"""Decode throughput at long contexts, where the paged attention kernel is a large part of a step.

    python -m benchmarks.long_context_decode [--seqs 32] [--prompt-len 1536] [--max-tokens 128]

`--seqs` prompts of `--prompt-len` seeded random token ids are prefilled once (one output token,
so the prefix cache keeps them), then the same prompts generate `--max-tokens` tokens each
(greedy, EOS ignored) and that second pass is timed: its prompts are served from the prefix
cache, so it is almost all decode steps over contexts of `--prompt-len` and more. The KV pool is
sized to hold every sequence (`--kv-cache-memory`), so nothing is preempted or recomputed.
Prints output tokens/s of the timed pass; run it once per build to compare (a process each).
"""

from __future__ import annotations

import argparse
import random
import time

from engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.seqs)]
    llm = LLM(max_num_seqs=args.seqs, max_model_len=args.prompt_len + args.max_tokens + 16,
              kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    tokens = args.seqs * args.max_tokens
    print(f"{args.seqs} sequences, contexts {args.prompt_len}-{args.prompt_len + args.max_tokens}: "
          f"{tokens / seconds:.1f} output tok/s ({seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
