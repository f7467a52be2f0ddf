"""Engine fixtures: one HF reference model and engines per block size, loaded once per session.
Every engine handed out is checked after each test: its block pool must be whole and free."""

from __future__ import annotations

import gc

import pytest
import torch

_MAX_CACHED_ENGINES = 3
_engines: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from engine.loop.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_cases(tokenizer):
    """The prompts of tests/engine/prompts.py's CASES, with their new-token counts."""
    from tests.engine.prompts import CASES, prompt_of_length

    return [(prompt_of_length(tokenizer, n, off), new) for n, new, off in CASES]


@pytest.fixture(scope="session")
def hf_reference(hf_model, hf_cases):
    """Per case of CASES: HF greedy tokens and, per position, its top-k (logprob, token id), best first.
    Computed once per session: a test that needs fewer new tokens of one of these prompts takes
    a prefix (greedy decoding's first k tokens do not depend on how many follow)."""
    from tests.engine.hf_reference import hf_greedy

    return [hf_greedy(hf_model, ids, new) for ids, new in hf_cases]


def get_llm(**kwargs):
    from engine.loop.llm import LLM

    key = tuple(sorted(kwargs.items()))
    if key in _engines:
        _engines[key] = _engines.pop(key)  # most recently used last
    else:
        while len(_engines) >= _MAX_CACHED_ENGINES:  # each engine holds its weights and KV pool
            _engines.pop(next(iter(_engines)))
            gc.collect()
        # NOTE: float32 and dense weights pinned: the tests compare with HF's fp32 model token for
        # token; `dtype="auto"` takes bf16 on a CPU that multiplies it natively, and the default
        # `quantization="auto"` keeps the GGUF's weights quantized (engine/core/config.py).
        args = {"max_model_len": 2048, "kv_cache_memory": "256MiB", "enable_prefix_caching": False,
                "dtype": "float32", "quantization": "none"}
        args.update(kwargs)
        _engines[key] = LLM(**args)
    return _engines[key]


@pytest.fixture
def make_llm():
    """make_llm(block_size=16, ...) -> a cached LLM; its pool is checked after the test."""
    used = []

    def make(**kwargs):
        llm = get_llm(**kwargs)
        used.append(llm)
        return llm

    yield make
    for llm in used:
        bm = llm.engine.block_manager
        bm.check_integrity()
        assert not llm.engine.has_unfinished_requests()
        assert bm.all_free(), "blocks leaked after the test"
