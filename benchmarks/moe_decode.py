"""Decode throughput of a mixture-of-experts model: a random-weight Qwen3-MoE shaped like
Qwen3-30B-A3B scaled down to fit a small CPU box, at 1 and at 16 sequences, with the experts' load.

    python -m benchmarks.moe_decode [--layers 8] [--experts 64] [--top-k 4] [--max-tokens 32]

Qwen3-30B-A3B is hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128 experts of 768,
top-8 (1/16 of the experts per token). The default here keeps its ratios at about half the
width: hidden 1024, 16 / 2 heads of 64, 64 experts of 256, top-4 (1/16; at 16 sequences, one
routed token per expert per layer and step, as 16 x 8 / 128 is there), 8 layers, the default
model's 49152-token vocabulary: ~520 M parameters (2.1 GB in float32; 400 M of them experts),
~95 M active per token (50 M of them the LM head).
Only a config.json is written (a temporary directory); the weights are `load_format="dummy"`.

For each of `--batch-sizes`, that many prompts of `--prompt-len` seeded random token ids are
prefilled once (one output token, so the prefix cache keeps them), then generate `--max-tokens`
tokens each (greedy, EOS ignored) and that pass is timed: almost all decode steps. During the
timed passes every MoE block counts its routed (token, expert) pairs
(`SparseMoE.tokens_per_expert`): every token the pass computes, its decode steps and the few
prompt tokens recomputed past the prefix cache's hit. Printed: tokens per expert summed over the
layers (min / max / mean over experts) and the worst layer's max / mean. NOTE: random weights
decoded greedily repeat tokens, so one sequence keeps hitting the same experts; the load shows
the routing at work, not how a trained model's router spreads tokens. `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from engine import LLM, SamplingParams
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from engine.worker.models.moe import SparseMoE


def write_config(path: str, args) -> None:
    from transformers import AutoTokenizer, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(default_gguf_path()))
    Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, intermediate_size=3 * args.hidden,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(path)


def decode_pass(llm: LLM, blocks: list[SparseMoE], seqs: int, args) -> dict:
    rng = random.Random(args.seed + seqs)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(seqs)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    for b in blocks:
        b.tokens_per_expert = torch.zeros(b.num_experts, dtype=torch.int64)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    per_layer = torch.stack([b.tokens_per_expert for b in blocks]).double()  # [layers, experts]
    for b in blocks:
        b.tokens_per_expert = None
    total = per_layer.sum(0)
    worst = (per_layer.max(1).values / per_layer.mean(1)).max().item()
    return {"seqs": seqs, "tokens_per_s": seqs * args.max_tokens / seconds, "seconds": seconds,
            "experts_min": int(total.min()), "experts_max": int(total.max()), "experts_mean": total.mean().item(),
            "worst_layer_max_over_mean": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="moe-decode-") as path:
        write_config(path, args)
        t0 = time.perf_counter()
        llm = LLM(model=path, load_format="dummy", tokenizer=str(gguf_tokenizer_dir(default_gguf_path())),
                  dtype=args.dtype, max_num_seqs=max(args.batch_sizes), kv_cache_memory="512MiB",
                  max_model_len=args.prompt_len + args.max_tokens + 16, seed=args.seed)
        load_s = time.perf_counter() - t0
        blocks = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]
        print(f"Qwen3-MoE, random weights: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
              f"{args.moe_intermediate}, top-{args.top_k}; {args.dtype}, {torch.get_num_threads()} threads; "
              f"started in {load_s:.1f} s")
        results = []
        for seqs in args.batch_sizes:
            r = decode_pass(llm, blocks, seqs, args)
            results.append(r)
            print(f"{seqs:3d} sequences: {r['tokens_per_s']:7.1f} output tok/s ({r['seconds']:.2f} s); tokens per "
                  f"expert over {len(blocks)} layers: min {r['experts_min']}, max {r['experts_max']}, mean "
                  f"{r['experts_mean']:.1f}; worst layer max/mean {r['worst_layer_max_over_mean']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
