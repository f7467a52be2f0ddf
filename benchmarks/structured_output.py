"""What structured outputs cost: the same batch decoded free and under a constraint, in one
process, plus the per-step mask cost alone.

    python -m benchmarks.structured_output --num-prompts 16 --max-tokens 32 --repeats 3

Both runs generate exactly max_tokens per prompt (EOS ignored; the regex never completes), so
the ratio of output tokens/s is the constraint's whole overhead (mask computation, bit unpacking,
feeding tokens back). The mask micro-benchmark times `apply_grammar_masks` on a batch of
fresh JSON-schema states at several batch sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.core.guided_decoding import GuidedDecoding
from engine.sample.structured_output import apply_grammar_masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}
FREE_TEXT = r"[A-Za-z0-9 ,.]+"  # never complete: runs to max_tokens like the free run


def timed_generate(llm: LLM, prompts, params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(o.error is None for o in outs), [o.error for o in outs]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt


def mask_cost(llm: LLM, batch: int, repeats: int) -> float:
    """Median seconds for one step's masks on `batch` rows."""
    compiler = llm.engine.structured_outputs
    spec = GuidedDecoding.json_schema(SCHEMA)
    states = [compiler.start(spec) for _ in range(batch)]
    vocab = llm.engine.model_config.hf_config.vocab_size
    logits = torch.randn(batch, vocab)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        apply_grammar_masks(logits, list(enumerate(states)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    llm = LLM(max_model_len=1024, kv_cache_memory="256MiB")
    prompts = [llm.engine.chat_prompt([{"role": "user", "content": f"Write note number {i} about the sea."}])
               for i in range(args.num_prompts)]
    base = dict(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    free = SamplingParams(**base)
    guided = SamplingParams(**base, guided_decoding=GuidedDecoding("regex", FREE_TEXT))
    timed_generate(llm, prompts[:2], guided)  # warm-up: the vocabulary index and the first compile
    rates: dict[str, list[float]] = {"free": [], "regex": []}
    for _ in range(args.repeats):  # interleaved, so that machine load hits both alike
        rates["free"].append(timed_generate(llm, prompts, free))
        rates["regex"].append(timed_generate(llm, prompts, guided))
    med = {k: statistics.median(v) for k, v in rates.items()}
    masks = {b: mask_cost(llm, b, 20) for b in (1, 16, 64)}
    result = {
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "tokens_per_s": med, "ratio_regex_over_free": med["regex"] / med["free"],
        "mask_ms_per_step": {str(b): 1000 * t for b, t in masks.items()},
        "torch_threads": torch.get_num_threads(),
    }
    print(f"free  {med['free']:.1f} tok/s   regex {med['regex']:.1f} tok/s   ratio {result['ratio_regex_over_free']:.3f}")
    print("mask per step: " + ", ".join(f"batch {b}: {1000 * t:.2f} ms" for b, t in masks.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
