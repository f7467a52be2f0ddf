"""How far each GGUF type moves the default model's next-token distributions, ours beside
llama.cpp's own measure of the same file.

From the default model's Q4_1 GGUF, llama-quantize (built from the llama-cpp-python sdist, as
benchmarks/llama_cpp_build.py builds llama-server) writes the same weights as F32 (the file
dequantized) and, from that F32 file, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K_M, Q5_K_M and Q6_K. For each quantized
file, against the F32 file, over a fixed English text of ~1,060 tokens (tests/engine/prompts.py):

  - ours: the file served as stored (`quantization="auto"`, this CPU's activation dtype) against
    the F32 file served dense in float32: mean KL divergence KL(F32 || quantized) and top-1
    agreement over every prompt position, scored in one pass;
  - llama.cpp's: `llama-perplexity --kl-divergence` against the F32 file's saved logits, with
    `-c 512` (it scores the second half of each 512-token chunk: ~510 positions of the text).

    python -m benchmarks.quant_quality [--out benchmarks/results/quant_quality.json]

The two columns are each server against its own F32 run, on the same files and text.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import time
from pathlib import Path

import torch

from benchmarks import llama_cpp_build

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"]


def prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """The full next-token logits at prompt positions 0 .. n-2, read as the runner scores the
    prompt (prompt_logprobs): its LM-head calls after the first (the last token's) are those rows."""
    from engine.core.sampling_params import SamplingParams

    model = llm.engine.executor.runner.model
    seen, compute = [], model.compute_logits
    model.compute_logits = lambda h: seen.append(compute(h).float()) or seen[-1]
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    finally:
        del model.compute_logits
    return torch.cat(seen[1:])


def kl_and_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || other) over rows of logits, and the fraction of rows whose argmax agrees."""
    lr, lo = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (lr.exp() * (lr - lo)).sum(-1)
    return kl.mean().item(), (lr.argmax(-1) == lo.argmax(-1)).float().mean().item()


def make_files(source: Path, out: Path) -> dict[str, Path]:
    """F32 and each type in TYPES (Q4_1: the source itself), written once into `out`."""
    quantize = llama_cpp_build.build_target("llama-quantize")
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "model-F32.gguf"
    if not f32.exists():
        _run([str(quantize), "--allow-requantize", str(source), str(f32), "F32"])
    files = {"F32": f32}
    for t in TYPES:
        target = source if t == "Q4_1" else out / f"model-{t}.gguf"
        if not target.exists():
            _run([str(quantize), str(f32), str(target), t])
        files[t] = target
    return files


def ours(files: dict[str, Path], ids: list[int]) -> dict[str, dict]:
    from engine.loop.llm import LLM

    args = dict(max_num_batched_tokens=2048, enable_prefix_caching=False)
    dense = LLM(str(files["F32"]), quantization="none", dtype="float32", **args)
    reference = prompt_logits(dense, ids)
    del dense
    found = {}
    for t in TYPES:
        llm = LLM(str(files[t]), quantization="auto", **args)
        kl, top1 = kl_and_top1(reference, prompt_logits(llm, ids))
        found[t] = {"mean_kl": kl, "top1": top1, "positions": len(ids) - 1,
                    "dtype": str(llm.engine.model_config.dtype).removeprefix("torch.")}
        print(f"ours   {t:7} KL {kl:.5f}  top-1 {top1:.4f}", flush=True)
        del llm
    return found


def llama_cpp(files: dict[str, Path], text_file: Path, out: Path) -> dict[str, dict]:
    perplexity = llama_cpp_build.build_target("llama-perplexity")
    base = out / "f32-logits.kld"
    common = ["-f", str(text_file), "-c", "512", "-t", "2", "-b", "512"]
    _run([str(perplexity), "-m", str(files["F32"]), *common, "--kl-divergence-base", str(base)])
    found = {}
    for t in TYPES:
        log = _run([str(perplexity), "-m", str(files[t]), *common, "--kl-divergence-base", str(base),
                    "--kl-divergence"])
        kl = re.search(r"Mean\s+KLD:\s+([-\d.]+)", log)
        top = re.search(r"Same top p:\s+([\d.]+)", log)
        found[t] = {"mean_kl": float(kl.group(1)) if kl else None,
                    "top1": float(top.group(1)) / 100 if top else None}
        print(f"llama  {t:7} KL {found[t]['mean_kl']}  top-1 {found[t]['top1']}", flush=True)
    return found


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def main() -> None:
    from engine.loop.tokenizer import load_tokenizer
    from engine.worker.models.loader import default_gguf_path
    from tests.engine.prompts import MORE_TEXT, TEXT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=llama_cpp_build.cache_dir() / "quant_quality")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quant_quality.json")
    args = ap.parse_args()
    source = default_gguf_path()
    files = make_files(source, args.work)
    text = TEXT + MORE_TEXT
    text_file = args.work / "text.txt"
    text_file.write_text(text)
    ids = load_tokenizer(str(source))(text, add_special_tokens=False).input_ids
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": _cpu(), "model": source.name, "text_tokens": len(ids),
        "ours": ours(files, ids), "llama_cpp": llama_cpp(files, text_file, args.work),
        "llama_cpp_version": llama_cpp_build.SDIST_VERSION,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
