#!/usr/bin/env bash
# GPU check for paged-serve, for one machine with a CUDA GPU, a CUDA build of torch and nvcc,
# and no network. Sized for about 8 minutes on an H200:
#   1. preflight: everything the steps need (ninja, pytest, nvcc, a CUDA torch, the daemon's
#      packages), each reported as ok or MISSING; a missing one stops the script (exit 2);
#   2. build the CUDA ops (a failed build is an error, never a fallback);
#   3. the CUDA kernel tests, 4. the kernel benchmark;
#   5. end to end: the daemon (`python -m server`) with dummy weights of llama-3-8b (bf16,
#      --gpu-memory-utilization 0.9): /health, its logged KV capacity, greedy determinism (one
#      request twice), then 64 and 256 concurrent streams (~1 minute): output tok/s, TTFT and
#      ITL percentiles, against the bandwidth roofline; 6. host overhead per engine step.
# Results (the log, JSON files, summary.json) go to $OUT if set, else a temporary folder.
#
#   scripts/gpu_check.sh               # on the GPU machine (python from $PYTHON, .venv or PATH)
#   GPU_CHECK_CPU=1 scripts/gpu_check.sh   # rehearsal on a CPU machine: the CPU ops, the tiny
#                                          # model, a small KV pool, short loads; GPU-only steps skip
#
# What the GPU machine lacks travels as wheels in .gpu_carry/ (scripts/gpu_prepare.sh makes
# it; name it in the device run's carry list): each one whose package is missing there, or
# older, is installed with pip --no-index --target into a temporary folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

CPU_MODE=${GPU_CHECK_CPU:-0}
RESULTS=${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/gpu_check.log") 2>&1
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
PYTHON=$(command -v "$PYTHON")
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PAGED_SERVE_OPS=compiled          # a failed build is an error here, never a fallback
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failures=()

step() { echo; echo "== $* ($(date +%T))"; }
fail() { echo "FAILED: $*"; failures+=("$*"); }

# NOTE: ninja is a Python package (a console script next to the interpreter), and the JIT build
# finds it on PATH only: put the running Python's bin/ and scripts directories there.
pybin=$("$PYTHON" -c 'import os, sys, sysconfig; print(os.path.dirname(sys.executable) + ":" + sysconfig.get_path("scripts"))')
export PATH="$pybin:$PATH"

step "carried packages"
carry=${GPU_CARRY:-.gpu_carry}
if [[ -d $carry/wheels ]]; then
  site=${GPU_CARRY_SITE:-${TMPDIR:-/tmp}/paged-serve-carry-site}
  # Wheels whose distribution is missing here, or older than the carried one.
  mapfile -t needed < <("$PYTHON" - "$carry/wheels" <<'PY'
import importlib.metadata as md, pathlib, re, sys
def key(v):
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v)[:4])
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or key(have) < key(version):
        print(whl)
PY
  )
  if (( ${#needed[@]} )); then
    rm -rf "$site" && mkdir -p "$site"
    echo "installing ${#needed[@]} carried wheels into $site: $(printf '%s ' "${needed[@]##*/}")"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${needed[@]}" \
      || fail "pip install of the carried wheels"
    export PYTHONPATH="$PYTHONPATH:$site" PATH="$site/bin:$PATH"
  else
    echo "every carried package is installed already"
  fi
else
  echo "no $carry/wheels (scripts/gpu_prepare.sh makes it): using what is installed"
fi

# torch guesses CUDA_HOME from the directory above `nvcc`, which is wrong when nvcc is a
# wrapper script (e.g. /usr/local/bin/nvcc): point it at a directory with the CUDA headers.
if [[ -z ${CUDA_HOME:-} ]]; then
  for home in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /)")")")"; do
    if [[ -f $home/include/cuda_runtime.h ]]; then export CUDA_HOME=$home; break; fi
  done
fi

step "preflight"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
missing=0
check() {  # check NAME COMMAND...: ok, or MISSING (counted)
  local name=$1; shift
  if out=$("$@" 2>&1); then echo "ok       $name: ${out##*$'\n'}"; else echo "MISSING  $name: ${out##*$'\n'}"; missing=$((missing + 1)); fi
}
check "python" "$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])'
check "ninja (on PATH, for the JIT build)" sh -c 'command -v ninja && ninja --version'
check "pytest" "$PYTHON" -c 'import pytest; print("pytest", pytest.__version__)'
for mod in fastapi uvicorn pydantic starlette llguidance transformers safetensors httpx yaml jinja2 prometheus_client; do
  check "$mod (the daemon)" "$PYTHON" -c "import $mod; print(getattr($mod, '__version__', 'importable'))"
done
if [[ $CPU_MODE == 1 ]]; then
  echo "skip     nvcc, CUDA torch, a visible GPU: GPU_CHECK_CPU=1 rehearses on the CPU"
else
  check "nvcc (CUDA_HOME=${CUDA_HOME:-unset})" sh -c '"${CUDA_HOME:-/nonexistent}/bin/nvcc" --version | tail -1'
  check "a CUDA torch with a visible GPU" "$PYTHON" -c 'import torch; assert torch.version.cuda, f"torch {torch.__version__} has no CUDA"; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
fi
if (( missing )); then
  echo "gpu_check: $missing prerequisite(s) missing (see MISSING above); carry them with scripts/gpu_prepare.sh"
  exit 2
fi
kind=$([[ $CPU_MODE == 1 ]] && echo cpu || echo cuda)

step "build the ${kind^^} ops"
timeout 420 "$PYTHON" - "$kind" <<'PY' || fail "build"
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
t = time.perf_counter()
from cuda_ext import ops
assert ops.backend() == sys.argv[1], ops.backend()
print(f"backend {ops.backend()} ready in {time.perf_counter() - t:.1f} s")
PY

step "kernel tests"
if [[ $CPU_MODE == 1 ]]; then  # a short sample: the whole suite is `pytest tests/kernels`
  timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_op_checks.py \
    tests/kernels/test_ops_backend.py::test_compiled_backend_loads_by_default || fail "kernel tests"
else
  # NOTE: -m cuda deselects everything unmarked, this backend test too: it runs on its own.
  timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/kernels || fail "CUDA kernel tests"
  timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_ops_backend.py::test_compiled_backend_loads_by_default || fail "backend test"
fi

step "kernel benchmark"
if [[ $CPU_MODE == 1 ]]; then
  echo "skip: the CUDA benchmark needs a GPU (benchmarks/kernels/bench_paged_attention.py runs on CPU too)"
else
  timeout 150 "$PYTHON" benchmarks/kernels/bench_paged_attention.py --device cuda --sweep | tee "$RESULTS/bench_paged_attention.txt" \
    || fail "kernel benchmark"
fi

step "end to end: the daemon"
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if [[ $CPU_MODE == 1 ]]; then
  model=configs/models/tiny-4kv.json
  server_flags=(--dtype float32 --kv-cache-memory 64MiB --max-num-seqs 32)
  load_plan=("8 10" "32 15")   # streams, seconds
  overhead_flags=(--batch 8 32 --context 64 --steps 5 --sampling greedy)
else
  model=configs/models/llama-3-8b.json
  server_flags=(--dtype bfloat16 --gpu-memory-utilization 0.9 --max-num-seqs 256)
  load_plan=("64 25" "256 35")
  overhead_flags=(--batch 64 256 --context 512 --steps 20 --sampling greedy)
fi
"$PYTHON" -m server "$model" --load-format dummy "${server_flags[@]}" --host 127.0.0.1 --port "$port" \
  --log-level info --disable-uvicorn-access-log >"$RESULTS/server.log" 2>&1 &
server_pid=$!
stop_server() { kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true; }
trap stop_server EXIT
export GPU_CHECK_URL="http://127.0.0.1:$port" GPU_CHECK_RESULTS=$RESULTS
timeout 1200 "$PYTHON" - "${load_plan[@]}" <<'PY' || fail "end to end"
"""The daemon end to end: health, KV capacity, greedy determinism, then concurrent streams."""
import asyncio, json, os, random, re, sys, time
from pathlib import Path

import httpx

from benchmarks.serve import RequestResult, compute_metrics

URL, RESULTS = os.environ["GPU_CHECK_URL"], Path(os.environ["GPU_CHECK_RESULTS"])
log = RESULTS / "server.log"
summary = {}

deadline = time.monotonic() + 300
while True:  # /health answers 200 once the engine is loaded
    try:
        health = httpx.get(URL + "/health", timeout=2)
        if health.status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the daemon did not become healthy in 300 s; see server.log")
    time.sleep(1)
summary["health"] = health.json()
text = log.read_text()
kv = re.search(r"KV cache: (\d+) device blocks of (\d+) tokens \(([\d.]+) GiB", text)
params = re.search(r"model ready: .*?, ([\d.]+) M parameters", text)
assert kv, "no 'KV cache: ... device blocks' line in server.log"
summary["kv_blocks"], summary["block_size"], summary["kv_gib"] = int(kv[1]), int(kv[2]), float(kv[3])
summary["kv_tokens"] = summary["kv_blocks"] * summary["block_size"]
summary["weights_bytes"] = float(params[1]) * 1e6 * (2 if "bfloat16" in text else 4) if params else None
model = httpx.get(URL + "/v1/models").json()["data"][0]["id"]
print(f"healthy; model {model}; KV cache {summary['kv_blocks']} blocks = {summary['kv_tokens']} tokens "
      f"({summary['kv_gib']} GiB)")

# Greedy determinism. NOTE: dummy weights have no tokenizer: prompts are token ids and the text
# is empty, so the per-token logprobs stand in for the tokens' identity. The prompt is shorter
# than one block, so that the second run cannot hit the prefix cache: a cached prefix computes
# the rest with other kernels (gather + masked SDPA), whose bf16 roundings differ in low bits.
body = {"model": model, "prompt": [(37 * i) % 1000 + 3 for i in range(15)], "max_tokens": 32,
        "temperature": 0, "logprobs": 1, "ignore_eos": True}
runs = [httpx.post(URL + "/v1/completions", json=body, timeout=300).json()["choices"][0] for _ in range(2)]
same = runs[0] == runs[1] and len(runs[0]["logprobs"]["token_logprobs"]) == 32
summary["greedy_deterministic"] = same
print("greedy output deterministic:", same)


async def stream(client, prompt, max_tokens):
    """One streamed completion; every chunk with a choice is a token event."""
    r = RequestResult(ok=False, prompt_tokens=len(prompt), start=time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", URL + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices"):
                    r.chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
        r.ok = bool(r.chunk_times)
    except (httpx.HTTPError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"[:200]
    return r


async def load(streams, seconds):
    """`streams` workers, each sending requests back to back for `seconds` (then finishing)."""
    rng = random.Random(streams)
    results = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        stop = time.perf_counter() + seconds

        async def worker():
            while time.perf_counter() < stop:
                prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(64, 512))]
                results.append(await stream(client, prompt, 128))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        duration = time.perf_counter() - start
    return compute_metrics(results, duration)


for plan in sys.argv[1:]:
    streams, seconds = map(int, plan.split())
    m = asyncio.run(load(streams, seconds))
    m["streams"] = streams
    if summary["weights_bytes"]:  # roofline: weights + the KV read per step at 4.8 TB/s
        mean_ctx = (m["total_input_tokens"] + m["total_output_tokens"] / 2) / max(m["completed"], 1)
        kv_per_token = summary["kv_gib"] * 2**30 / summary["kv_tokens"]
        step_s = (summary["weights_bytes"] + streams * mean_ctx * kv_per_token) / 4.8e12
        m["roofline_output_tok_s"] = streams / step_s
    (RESULTS / f"load_{streams}.json").write_text(json.dumps(m, indent=2))
    summary[f"load_{streams}"] = {k: m.get(k) for k in ("completed", "failed", "errors", "output_throughput",
                                                        "ttft_ms", "itl_ms", "roofline_output_tok_s")}
    print(f"{streams} streams: {m['completed']} done, {m['failed']} failed, {m['output_throughput']:.0f} output tok/s"
          f" (roofline {m.get('roofline_output_tok_s') or 0:.0f}); TTFT ms p50/p90/p99 "
          f"{m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p90']:.0f}/{m['ttft_ms']['p99']:.0f}; ITL ms p50/p90/p99 "
          f"{m['itl_ms']['p50']:.1f}/{m['itl_ms']['p90']:.1f}/{m['itl_ms']['p99']:.1f}")
    assert m["failed"] == 0, m["errors"]
(RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
assert summary["greedy_deterministic"], "two greedy runs of one request differ"
PY
stop_server
trap - EXIT
grep -E "KV cache:|model ready|ERROR|Traceback" "$RESULTS/server.log" | head -20 || true

step "host overhead per engine step (benchmarks/step_overhead.py, the tiny model)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 240 "$PYTHON" -m benchmarks.step_overhead "${overhead_flags[@]}" \
  | tee "$RESULTS/step_overhead.md" || fail "step overhead"

step "done: results in $RESULTS"
ls -l "$RESULTS"
if (( ${#failures[@]} )); then
  printf 'gpu_check: %d step(s) failed: %s\n' "${#failures[@]}" "$(printf '%s; ' "${failures[@]}")"
  exit 1
fi
echo "gpu_check: every step passed"
