"""What sharing KV blocks saves: (a) within a request (parallel samples and beams share blocks
copy-on-write), (b) across requests (automatic prefix caching of a shared system prompt).

Part (a), `saving`: ten short Alpaca-like instructions (in the model's chat template) run
together through the offline engine (prefix caching off, so only sharing inside a request
counts), once per setting: parallel sampling with n = 2, 4, 8 (temperature 1) and beam search
with widths 2, 4, 8 (length_penalty 1). Right after every `schedule()` (the fullest point of a
step) it counts the device blocks really held ("shared") and the blocks the same running
sequences would hold with private copies ("private": the sum of their block-table lengths).
Saving = 1 - shared / private, at the peak and summed over all steps (the vLLM paper's
figure, 6-10% for parallel sampling and 38-55% for beam search on Alpaca with OPT-13B, is of
the second kind).

    OMP_NUM_THREADS=1 python -m benchmarks.sharing saving --json benchmarks/results/sharing_saving.json

Part (b), `prefix`: a system prompt of about 1,000 tokens and 64 requests with different short
user turns, offline through LLMEngine with arrival times (Poisson at --request-rate, or all at
once with `inf`): the engine is stepped in real time and a request is added when its arrival
time has passed, with that arrival time, so TTFT includes queueing. It runs twice, on fresh
engines, with and without prefix caching; greedy with ignore_eos, so both generate the same
number of tokens. Reports TTFT p50/p99, end-to-end latency, throughput (output tokens/s and
requests/s from the first arrival to the last finish), prompt tokens served from the cache,
and how many outputs are identical between the two runs.

    OMP_NUM_THREADS=1 python -m benchmarks.sharing prefix --json benchmarks/results/sharing_prefix.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/sharing.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serve import percentile
from engine import LLM, SamplingParams
from engine.loop.llm_engine import LLMEngine
from engine.loop.tokenizer import apply_chat_template

# Short instructions in the style of the Alpaca data set (written for this benchmark).
INSTRUCTIONS = [
    "Give three tips for staying healthy.",
    "What are the three primary colors?",
    "Describe the structure of an atom.",
    "How can we reduce air pollution?",
    "Write a short poem about the ocean.",
    "Explain why the sky is blue.",
    "Suggest a name for a new coffee shop.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List four benefits of regular exercise.",
    "Translate 'good morning' into Spanish and French.",
]

# Different short user turns for the shared-system-prompt workload (64 are made from these).
QUESTIONS = [
    "Who kept the lighthouse running?",
    "How should salt be added to soup?",
    "Why are there infinitely many primes?",
    "What did the decimal system change?",
    "How do programmers find a bug?",
    "When should seeds be planted?",
    "Why did cities grow along rivers?",
    "What do tomatoes need?",
]
TOPICS = ["Answer in one sentence.", "Answer briefly.", "Use simple words.", "Be precise.",
          "Answer for a child.", "Give one example.", "Answer in a list.", "Answer politely."]


# ---------------------------------------------------------------------------------------------
# (a) the sharing saving inside a request


class PoolObserver:
    """Counts, right after each schedule(), the device blocks held and the blocks the running
    sequences' tables list (what private copies would hold)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.steps: list[tuple[int, int]] = []  # (shared, private) per step
        self._schedule = engine.scheduler.schedule
        # NOTE: wrapping the instance's method observes the pool at its fullest point in a step
        # (new and copied blocks allocated, nothing freed yet) without touching engine code.
        engine.scheduler.schedule = self._observe

    def _observe(self):
        out = self._schedule()
        bm = self.engine.block_manager
        shared = bm.usage().device_used
        private = bm.num_table_entries()
        if private:
            self.steps.append((shared, private))
        return out

    def close(self) -> None:
        self.engine.scheduler.schedule = self._schedule

    def summary(self) -> dict:
        peak_shared = max(s for s, _ in self.steps)
        peak_private = max(p for _, p in self.steps)
        total_shared = sum(s for s, _ in self.steps)
        total_private = sum(p for _, p in self.steps)
        return {
            "steps": len(self.steps),
            "peak_blocks_shared": peak_shared,
            "peak_blocks_private": peak_private,
            "peak_saving": 1 - peak_shared / peak_private,
            "mean_blocks_shared": total_shared / len(self.steps),
            "mean_blocks_private": total_private / len(self.steps),
            "saving_over_steps": 1 - total_shared / total_private,
        }


def run_saving(args) -> dict:
    llm = LLM(
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=False,
        max_num_seqs=128,
        seed=args.seed,
    )
    engine = llm.engine
    tok = llm.tokenizer
    prompts = [
        tok(apply_chat_template(tok, [{"role": "user", "content": q}]), add_special_tokens=False).input_ids
        for q in INSTRUCTIONS
    ]
    settings = [("parallel", w) for w in args.widths] + [("beam", w) for w in args.widths]
    rows = []
    for kind, width in settings:
        if kind == "parallel":
            params = SamplingParams(n=width, temperature=1.0, max_tokens=args.max_tokens, seed=args.seed)
        else:
            params = SamplingParams(
                n=1, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=args.max_tokens
            )
        observer = PoolObserver(engine)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        observer.close()
        assert engine.block_manager.all_free()
        out_lens = [len(o.token_ids) for r in outs for o in r.outputs]
        row = {
            "kind": kind,
            "width": width,
            "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "mean_output_tokens": sum(out_lens) / len(out_lens),
            "seconds": elapsed,
            **observer.summary(),
        }
        rows.append(row)
        print(
            f"{kind:8s} {width}: blocks at peak {row['peak_blocks_shared']:4d} shared vs "
            f"{row['peak_blocks_private']:4d} private ({100 * row['peak_saving']:.1f}% saved); "
            f"over steps {100 * row['saving_over_steps']:.1f}% saved; "
            f"prompt {row['mean_prompt_tokens']:.0f} / output {row['mean_output_tokens']:.0f} tokens; "
            f"{elapsed:.0f} s",
            flush=True,
        )
    return {
        "benchmark": "sharing_saving",
        "model": engine.model_config.served_model_name,
        "block_size": args.block_size,
        "max_tokens": args.max_tokens,
        "num_prompts": len(prompts),
        "paper": {"parallel_sampling_saving": [0.061, 0.098], "beam_search_saving": [0.376, 0.552]},
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# (b) a shared system prompt, with and without prefix caching


def system_prompt(tokenizer, target_tokens: int) -> str:
    """About `target_tokens` tokens: instructions followed by reference notes to answer from."""
    from tests.engine.prompts import TEXT

    head = "You are a helpful assistant for a public library. Answer only from the notes below.\n\nNotes:\n"
    words = TEXT.split()
    text, i = head, 0
    while len(tokenizer(text, add_special_tokens=False).input_ids) < target_tokens:
        text += " ".join(words[i : i + 20]) + " "
        i = (i + 20) % len(words)
    return text.strip()


def make_requests(tokenizer, n: int, system_tokens: int) -> list[list[int]]:
    system = system_prompt(tokenizer, system_tokens)
    out = []
    for i in range(n):
        user = f"{QUESTIONS[i % len(QUESTIONS)]} {TOPICS[(i // len(QUESTIONS)) % len(TOPICS)]}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out.append(tokenizer(apply_chat_template(tokenizer, messages), add_special_tokens=False).input_ids)
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_prefix_once(args, prompts: list[list[int]], caching: bool) -> tuple[dict, dict[str, list[int]]]:
    llm = LLM(
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=caching,
        seed=args.seed,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    pending = list(enumerate(zip(offsets, prompts)))
    done = {}
    peak_usage = 0.0
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0][1][0] <= now:
            i, (offset, ids) = pending.pop(0)
            engine.add_request(f"r{i}", ids, params, arrival_time=start + offset)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1][0] - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak_usage = max(peak_usage, engine.last_stats.kv_cache_usage)
    end = time.monotonic()
    ttfts = [o.metrics.time_to_first_token for o in done.values()]
    e2es = [o.metrics.e2e_latency for o in done.values()]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    stats = engine.last_stats
    result = {
        "prefix_caching": caching,
        "num_requests": len(done),
        "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99), "mean": sum(ttfts) / len(ttfts)},
        "e2e_s": {"p50": percentile(e2es, 50), "p99": percentile(e2es, 99)},
        "duration_s": end - start,
        "output_tokens_per_s": out_tokens / (end - start),
        "requests_per_s": len(done) / (end - start),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_from_cache": sum(o.num_cached_tokens for o in done.values()),
        "prefix_cache_queries_total": stats.prefix_cache_queries_total,
        "prefix_cache_hits_total": stats.prefix_cache_hits_total,
        "num_gpu_blocks": stats.num_device_blocks,
        "peak_kv_cache_usage": peak_usage,  # after a step, fraction of device blocks in use
        "num_preemptions": dict(stats.num_preemptions_total),
    }
    tokens = {rid: o.outputs[0].token_ids for rid, o in done.items()}
    del llm, engine
    return result, tokens


def run_prefix(args) -> dict:
    from engine.loop.tokenizer import load_tokenizer
    from engine.worker.models.loader import resolve_model

    tokenizer = load_tokenizer(resolve_model(None)[0])
    prompts = make_requests(tokenizer, args.num_requests, args.system_tokens)
    runs, outputs = [], []
    for caching in (True, False):
        result, tokens = run_prefix_once(args, prompts, caching)
        runs.append(result)
        outputs.append(tokens)
        print(
            f"prefix caching {'on ' if caching else 'off'}: TTFT p50 {result['ttft_s']['p50']:.2f} s, "
            f"p99 {result['ttft_s']['p99']:.2f} s; {result['output_tokens_per_s']:.1f} output tok/s, "
            f"{result['requests_per_s']:.2f} req/s; {result['prompt_tokens_from_cache']} of "
            f"{result['prompt_tokens']} prompt tokens from the cache; {result['num_preemptions']} preemptions; "
            f"{result['duration_s']:.0f} s",
            flush=True,
        )
    same = sum(outputs[0][rid] == outputs[1][rid] for rid in outputs[0])
    print(f"identical outputs with and without caching: {same} of {len(outputs[0])}")
    return {
        "benchmark": "sharing_prefix",
        "system_prompt_tokens": len(tokenizer(system_prompt(tokenizer, args.system_tokens)).input_ids),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "request_rate": args.request_rate,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "identical_outputs": same,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("saving", "prefix"):
        p = sub.add_parser(name)
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--kv-cache-memory", default="1GiB")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="write the results here")
    s = sub.choices["saving"]
    s.add_argument("--widths", type=lambda v: [int(x) for x in v.split(",")], default=[2, 4, 8])
    s.add_argument("--max-tokens", type=int, default=64)
    p = sub.choices["prefix"]
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=1.0, help="requests/s (Poisson), or inf")
    args = parser.parse_args(argv)
    result = run_saving(args) if args.cmd == "saving" else run_prefix(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
