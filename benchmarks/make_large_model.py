"""The larger models of the llama.cpp comparison, made here: a Llama with SmolLM2-1.7B's shapes
(hidden 2048, 24 layers, 32 heads, MLP 8192, tied embeddings), with `--size 8b` Llama-3-8B's
(hidden 4096, 32 layers, 32 query and 8 key/value heads, MLP 14336, untied embeddings), or with
`--size 360m` SmolLM2-360M's (hidden 960, 32 layers, 15 / 5 heads, MLP 2560, tied), each with the
default model's vocabulary and tokenizer and random weights (nothing is downloaded), as

  - an HF directory with bf16 safetensors (what `paged-serve DIR --quantization q4_k` or vLLM load),
  - a GGUF converted from it by llama.cpp's own convert_hf_to_gguf.py (bf16),
  - that GGUF quantized to Q4_K_M by llama-quantize,

both tools from the llama-cpp-python sdist that benchmarks/llama_cpp_build.py builds llama-server
from (the `llama-quantize` target is built here when missing). Prints the Q4_K_M file's path.

    python -m benchmarks.make_large_model [--out DIR]   # ~4 GB of disk, a few minutes on 2 cores
    python -m benchmarks.compare_llama_cpp --model DIR/model-1.7b-Q4_K_M.gguf --points 1:4,4:8,16:32
    python -m benchmarks.make_large_model --size 8b     # ~35 GB of disk while made (20 kept), 16 GB of memory
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import llama_cpp_build

SHAPES = {
    # NOTE: 960-wide rows are not whole 256-value K-quant blocks: llama-quantize's Q4_K_M falls back
    # to Q5_0 (for Q4_K) and Q8_0 (for Q6_K) on every tensor but ffn_down, as in the real SmolLM2-360M's
    "360m": {"hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
             "intermediate_size": 2560, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": True},
    "1.7b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
             "intermediate_size": 8192, "max_position_embeddings": 8192, "rope_theta": 130000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False},
}


def make_hf_dir(out: Path, size: str, seed: int = 0) -> Path:
    """The random-weight HF checkpoint (bf16 safetensors) with the default model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir

    target = out / f"model-{size}-hf"
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(default_gguf_path()))
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **SHAPES[size])
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # NOTE: cast on the meta device, before any storage exists: at 8b fp32 storage would be 30 GB
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))
    tmp = target.with_suffix(".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def llama_cpp_source() -> Path:
    return llama_cpp_build.cache_dir() / f"llama_cpp_python-{llama_cpp_build.SDIST_VERSION}" / "vendor" / "llama.cpp"


def convert(hf_dir: Path, out: Path, size: str) -> Path:
    """convert_hf_to_gguf.py (with the sdist's own gguf-py) to a bf16 GGUF."""
    target = out / f"model-{size}-BF16.gguf"
    if target.exists():
        return target
    src = llama_cpp_source()
    try:
        import sentencepiece  # noqa: F401 (convert_hf_to_gguf.py imports it at the top)
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"], check=True)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16",
                    "--outfile", str(target)], check=True, env=env)
    return target


def quantize(bf16: Path, out: Path, size: str) -> Path:
    target = out / f"model-{size}-Q4_K_M.gguf"
    if target.exists():
        return target
    binary = llama_cpp_build.build_target("llama-quantize")
    subprocess.run([str(binary), str(bf16), str(target), "Q4_K_M"], check=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=llama_cpp_build.cache_dir().parent / "models")
    ap.add_argument("--size", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--keep-bf16-gguf", action="store_true",
                    help="keep the bf16 GGUF that the Q4_K_M file is quantized from (deleted by default at 8b)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llama_cpp_build.ensure_llama_server()  # the sdist (and its build tree) the tools come from
    bf16 = convert(make_hf_dir(args.out, args.size), args.out, args.size)
    quantized = quantize(bf16, args.out, args.size)
    if args.size == "8b" and not args.keep_bf16_gguf:
        bf16.unlink()  # NOTE: 15 GB at 8b that nothing reads again; the HF copy stays for --quantization runs
    print(quantized)


if __name__ == "__main__":
    main()
