"""The llama.cpp comparison's workload: seeded, in the buckets the issue names, counted with the
model's own tokenizer; and the binary lookup order."""

from __future__ import annotations

import os
import random
import stat

from benchmarks.compare_llama_cpp import OUTPUT_BUCKETS, PROMPT_BUCKETS, draw, make_workload
from benchmarks.llama_cpp_build import cache_dir, cmake_flags, find_llama_server


def test_lengths_follow_the_buckets():
    rng = random.Random(0)
    prompts = [draw(rng, PROMPT_BUCKETS) for _ in range(20_000)]
    outputs = [draw(rng, OUTPUT_BUCKETS) for _ in range(20_000)]
    assert 8 <= min(prompts) and max(prompts) < 512 and 16 <= min(outputs) and max(outputs) < 256
    share = sum(p < 64 for p in prompts) / len(prompts)
    assert abs(share - 0.70) < 0.02
    assert abs(sum(o >= 160 for o in outputs) / len(outputs) - 0.05) < 0.01


def test_the_workload_is_seeded_and_counted_by_the_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    a, b = make_workload(12, 3, tokenizer), make_workload(12, 3, tokenizer)
    assert [(p.text, m) for p, m in a] == [(p.text, m) for p, m in b]
    for prompt, max_tokens in a:
        n = len(tokenizer.encode(prompt.text, add_special_tokens=False))
        assert abs(n - prompt.num_tokens) <= 2 and 8 <= prompt.num_tokens < 512 and 16 <= max_tokens < 256


def test_an_explicit_binary_comes_first(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("LLAMA_SERVER", "/nonexistent")
    assert find_llama_server(str(binary)) == binary
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert find_llama_server() == binary
    assert os.access(binary, os.X_OK)


def test_the_build_leaves_out_amx_on_x86_only():
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-int8" in cmake_flags("x86_64")
    assert not any("amx" in f for f in cmake_flags("aarch64"))
    assert "-DLLAMA_CURL=OFF" in cmake_flags("aarch64")


def test_a_cached_build_with_other_flags_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_SERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    build = cache_dir() / "build"
    binary = build / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    assert find_llama_server() is None  # no stamp: built before the flags were recorded
    (build / "paged-serve-cmake-flags.txt").write_text("-DGGML_NATIVE=ON")
    assert find_llama_server() is None
    (build / "paged-serve-cmake-flags.txt").write_text(" ".join(cmake_flags()))
    assert find_llama_server() == binary
