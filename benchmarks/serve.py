"""Load generator for any OpenAI-compatible server: streaming /v1/completions over async httpx.

Prompts are cut from a built-in corpus (or `--dataset FILE`) to lengths drawn from the skewed
distribution of benchmarks/workload.py, scaled so that prompt + `--max-tokens` fits in
`--max-model-len`. Lengths are in tokens counted by the server's POST /tokenize when it has
one, otherwise estimated from words, at a tokens-per-word ratio taken from the usage of one
1-token completion (or `--tokens-per-word`); token totals come from the server's usage.
Requests arrive all at once (`--request-rate inf`) or as a Poisson process at a given rate,
at most `--concurrency` in flight. The same prompts are sent at every rate of a sweep
(`--request-rates 1,2,4,inf`) unless `--fresh-prompts` draws new ones for each rate.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --model M \\
        --num-prompts 200 --max-tokens 128 --ignore-eos --request-rates 1,2,4,inf --json r.json

Metrics (as vLLM's benchmark_serving defines them), over successful requests:
  TTFT  time from sending a request to its first non-empty text chunk;
  TPOT  (e2e - TTFT) / (output tokens - 1), per request with more than one output token;
  ITL   gaps between successive text chunks, pooled over all requests;
  E2E   time from sending a request to its last chunk.
Throughputs divide by the wall time from the first send to the last completion.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: python benchmarks/serve.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serve_metrics import (  # noqa: F401 (re-exported: other benchmarks import them from here)
    PERCENTILES,
    Prompt,
    RequestResult,
    compute_metrics,
    format_table,
    percentile,
    summarize_ms,
)
from benchmarks.workload import TextSource, sample_lengths


def completion_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool,
                    extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension; dropped if the server rejects it
    return {**body, **(extra or {})}


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: Prompt,
                       max_tokens: int, ignore_eos: bool, extra: dict | None = None
                       ) -> RequestResult:
    """Send one streaming completion and time its chunks. Failures are results, not raises."""
    result = RequestResult(ok=False, prompt_tokens=prompt.num_tokens)
    body = completion_body(model, prompt.text, max_tokens, ignore_eos, extra)
    result.start = time.perf_counter()
    usage_tokens = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return result
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    result.chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    # the server's own prompt count beats our estimate
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", result.prompt_tokens)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.output_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)
    result.ok = True
    if not result.chunk_times:
        result.error = "no output chunks"
    return result


async def warm_up(client: httpx.AsyncClient, base_url: str, model: str, ignore_eos: bool,
                  extra: dict | None = None) -> bool:
    """Send one tiny request; with `ignore_eos`, return whether the server accepted it.

    Raises httpx errors if the server cannot be reached, or rejects even a plain request.
    """
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, **(extra or {})}
    if ignore_eos:
        resp = await client.post(f"{base_url}/v1/completions", json={**body, "ignore_eos": True})
        if resp.status_code == 200:
            return True
    resp = await client.post(f"{base_url}/v1/completions", json=body)
    resp.raise_for_status()
    return False


class TokenCounter:
    """Counts prompt tokens with the server's POST /tokenize, or estimates them from words.

    Without /tokenize the tokens-per-word ratio is calibrated from the `usage.prompt_tokens`
    of one 1-token completion of a sample text, or else `tokens_per_word` is assumed.
    """

    SAMPLE_WORDS = 400

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str,
                 tokens_per_word: float, extra: dict | None = None):
        self.client, self.base_url, self.model = client, base_url, model
        self.tokens_per_word = tokens_per_word
        self.extra = extra or {}
        self.source = "assumed"  # how tokens are counted: "tokenize", "usage" or "assumed"

    async def detect(self) -> None:
        """Find the best way to count; never raises for a server that lacks an endpoint."""
        sample = TextSource.builtin(seed=12345, num_words=self.SAMPLE_WORDS).text(0, self.SAMPLE_WORDS)
        try:
            n = await self._server_count(sample)
            self.source = "tokenize"
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            try:
                resp = await self.client.post(f"{self.base_url}/v1/completions", json={
                    "model": self.model, "prompt": sample, "max_tokens": 1, **self.extra})
                resp.raise_for_status()
                n = int(resp.json()["usage"]["prompt_tokens"])
                self.source = "usage"
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return
        self.tokens_per_word = n / self.SAMPLE_WORDS

    async def _server_count(self, text: str) -> int:
        resp = await self.client.post(f"{self.base_url}/tokenize",
                                      json={"model": self.model, "prompt": text})
        resp.raise_for_status()
        data = resp.json()
        return int(data["count"]) if "count" in data else len(data["tokens"])

    async def count(self, text: str) -> int:
        if self.source == "tokenize":
            return await self._server_count(text)
        return max(1, round(len(text.split()) * self.tokens_per_word))

    @property
    def method(self) -> str:
        if self.source == "tokenize":
            return "server /tokenize"
        how = "from usage" if self.source == "usage" else "assumed"
        return f"estimated, {self.tokens_per_word:.3g} tokens/word ({how})"


async def build_prompts(lengths: list[int], source: TextSource, counter: TokenCounter,
                        rng: random.Random, limit: int) -> list[Prompt]:
    """One prompt per target length, cut from `source` at a random offset.

    The word count comes from the measured tokens-per-word ratio; with a server tokenizer the
    prompt is re-cut once if it misses its target by more than 5%, then shortened until it
    has at most `limit` tokens (so prompt + max_tokens fits the context).
    """
    offsets = [rng.randrange(len(source.words)) for _ in lengths]
    sem = asyncio.Semaphore(16)

    async def one(target: int, offset: int) -> Prompt:
        async with sem:
            words = max(1, round(target / counter.tokens_per_word))
            text = source.text(offset, words)
            n = await counter.count(text)
            if counter.source == "tokenize" and abs(n - target) > 0.05 * target:
                words = max(1, round(words * target / max(n, 1)))
                text = source.text(offset, words)
                n = await counter.count(text)
            while n > limit and words > 1:
                words = max(1, min(words - 1, words * limit // n))
                text = source.text(offset, words)
                n = await counter.count(text)
            return Prompt(text, n)

    return list(await asyncio.gather(*(one(t, o) for t, o in zip(lengths, offsets))))


# ---------------------------------------------------------------------------------------------
# Running a benchmark
# ---------------------------------------------------------------------------------------------

async def run_at_rate(client: httpx.AsyncClient, args: argparse.Namespace, prompts: list[Prompt],
                      rate: float, ignore_eos: bool) -> dict:
    """Send every prompt at `rate` requests/s (inf: all at once) and return the metrics."""
    rng = random.Random(args.seed + 1)  # the same arrival pattern for a rate in every run
    sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None

    async def limited(prompt: Prompt) -> RequestResult:
        async with sem or contextlib.nullcontext():
            return await send_request(client, args.base_url, args.model, prompt,
                                      args.max_tokens, ignore_eos, args.extra_body)

    tasks = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(limited(prompt)))
    results = await asyncio.gather(*tasks)
    duration = max((r.chunk_times[-1] for r in results if r.chunk_times),
                   default=time.perf_counter()) - start
    metrics = compute_metrics(list(results), duration)
    return {"request_rate": rate if math.isfinite(rate) else "inf", **metrics}


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Build the prompts once, then run every requested rate; returns the JSON report."""
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    rates = parse_rates(args.request_rates or str(args.request_rate))
    prompt_budget = args.max_model_len - args.max_tokens
    if prompt_budget < 2 or args.num_prompts < 1:
        raise SystemExit("need --num-prompts >= 1 and --max-model-len >= --max-tokens + 2")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        counter = TokenCounter(client, args.base_url, args.model, args.tokens_per_word,
                               args.extra_body)
        if not args.no_tokenize:
            await counter.detect()
        source = (TextSource.from_file(args.dataset) if args.dataset
                  else TextSource.builtin(seed=args.seed))

        async def make_prompts(seed: int) -> list[Prompt]:
            rng = random.Random(seed)
            lengths = sample_lengths(args.num_prompts, rng, prompt_budget)
            return await build_prompts(lengths, source, counter, rng, prompt_budget)

        # NOTE: with --fresh-prompts each rate gets its own prompts (seed + its index in the
        # sweep), so a server's prefix cache cannot reuse the previous rate's prompts.
        prompt_sets = ([await make_prompts(args.seed + i) for i in range(len(rates))]
                       if args.fresh_prompts else [await make_prompts(args.seed)] * len(rates))
        ignore_eos = await warm_up(client, args.base_url, args.model, args.ignore_eos,
                                   args.extra_body)
        if args.ignore_eos and not ignore_eos:
            print("note: the server rejected ignore_eos; sending requests without it",
                  file=sys.stderr)
        points = [await run_at_rate(client, args, prompts, rate, ignore_eos)
                  for prompts, rate in zip(prompt_sets, rates)]
    prompt_tokens = [p.num_tokens for prompts in prompt_sets for p in prompts]
    return {
        "label": args.label or f"{args.model} @ {args.base_url}",
        "base_url": args.base_url,
        "model": args.model,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "dataset": args.dataset or "builtin",
        "fresh_prompts": args.fresh_prompts,
        "ignore_eos_requested": args.ignore_eos,
        "ignore_eos_sent": ignore_eos,
        "extra_body": args.extra_body,
        "token_counting": counter.method,
        "prompt_tokens": {"mean": statistics.fmean(prompt_tokens), "min": min(prompt_tokens),
                          "p50": percentile(prompt_tokens, 50), "max": max(prompt_tokens)},
        "points": points,
    }


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"request rates must be positive numbers or inf, got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (a trailing /v1 is ignored)")
    p.add_argument("--model", required=True, help="model name sent in every request")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="model context: prompt lengths are scaled to it minus --max-tokens")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens tokens (if the server accepts ignore_eos)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--request-rates", help="a sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    p.add_argument("--concurrency", type=int, default=0, help="max requests in flight (0: no limit)")
    p.add_argument("--dataset", help="a text file to cut prompts from (default: built-in corpus)")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="fields merged into every request body, for server-specific options")
    p.add_argument("--tokens-per-word", type=float, default=1.3,
                   help="assumed when the server has neither /tokenize nor completion usage")
    p.add_argument("--no-tokenize", action="store_true", help="ask the server nothing: assume --tokens-per-word")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh-prompts", action="store_true",
                   help="new prompts for each rate of a sweep (seed + index), so prefix caches "
                        "cannot reuse an earlier rate's prompts")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--label", help="series name in the JSON and in plot_serve.py")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run_benchmark(args))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(p["failed"] == 0 for p in report["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
