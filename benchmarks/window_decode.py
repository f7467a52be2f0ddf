"""Decode past a sliding window: a random-weight model shaped like Gemma 3 1B (hidden 1152, 4
query / 1 KV heads of 256, window 512, intermediate 6912; fewer layers than its 26 to stay short)
with prompts longer than the window, at 1 and at 16 sequences, attended two ways in one process:

* ``torch``: the windowed layers' attention in torch per sequence (`_attend_exact`), what the
  backend did before the CPU kernels took windows and soft-caps;
* ``kernels``: the compiled kernels with the window (``_kernels_apply`` as it is now).

The two alternate (torch, kernels, torch, ...) over the same prefilled prompts (prefix cache), so
a busy machine weighs on both alike; printed: tokens/s of each and the ratio kernels / torch.

    python -m benchmarks.window_decode [--layers 6] [--prompt-len 768] [--max-tokens 16] [--reps 2]

Only a config.json is written (a temporary directory); the weights are ``load_format="dummy"``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from engine import LLM, SamplingParams
from engine.worker import attention_backend
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir


def write_config(path: str, args) -> None:
    from transformers import AutoTokenizer, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(default_gguf_path()))
    Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=1152, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, intermediate_size=6912, sliding_window=args.window,
        max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=0, architectures=["Gemma3ForCausalLM"],
    ).save_pretrained(path)


def torch_past_the_window(window, softcap, q, key_cache, meta) -> bool:
    """The rule before: the kernels only for a layer with nothing to compute."""
    return not window and not softcap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as path:
        write_config(path, args)
        llm = LLM(model=path, tokenizer=str(gguf_tokenizer_dir(default_gguf_path())), load_format="dummy",
                  dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16, enable_prefix_caching=True,
                  max_num_seqs=max(args.batch_sizes), kv_cache_memory="512MiB")
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(max(args.batch_sizes))]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # prefilled once
        kernels_rule = attention_backend._kernels_apply
        for seqs in args.batch_sizes:
            times: dict[str, list[float]] = {"torch": [], "kernels": []}
            for _ in range(args.reps):
                for name, rule in (("torch", torch_past_the_window), ("kernels", kernels_rule)):
                    attention_backend._kernels_apply = rule
                    t0 = time.perf_counter()
                    llm.generate(prompts[:seqs], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                ignore_eos=True))
                    times[name].append(time.perf_counter() - t0)
            attention_backend._kernels_apply = kernels_rule
            best = {k: min(v) for k, v in times.items()}
            tps = {k: seqs * args.max_tokens / t for k, t in best.items()}
            print(f"{seqs:2d} seqs x {args.prompt_len} + {args.max_tokens} tokens, {args.layers} layers: "
                  f"torch {tps['torch']:.1f} tok/s, kernels {tps['kernels']:.1f} tok/s, "
                  f"kernels / torch {best['torch'] / best['kernels']:.2f}x "
                  f"(median {statistics.median(times['torch']) / statistics.median(times['kernels']):.2f}x; passes: "
                  f"torch {' '.join(f'{t:.2f}' for t in times['torch'])} s, "
                  f"kernels {' '.join(f'{t:.2f}' for t in times['kernels'])} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
