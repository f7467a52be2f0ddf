"""Every family we serve equals HF transformers token for token (greedy, fp32) on a tiny
random-weight model of its own config class: each prompt alone, all batched, prefilled in
chunks of a 16-token budget, with prefix-cache hits, and under swap and recompute preemption.
The block pool is checked whole and free after each run."""

from __future__ import annotations

import random

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.families.tiny_models import FAMILIES, VOCAB, build, save

NEW = 12
LENGTHS = (5, 23, 41, 70)  # several blocks of 4, and chunks of the 16-token budget


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(gguf_tokenizer_dir(default_gguf_path()))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer_dir):
    """(name, model dir, prompts, HF references) of one family's tiny model."""
    name = request.param
    hf = build(name)
    path = save(hf, tmp_path_factory.mktemp(name))
    # NOTE: our runs ignore EOS (every prompt gets NEW tokens); HF's generate would stop at it
    # (the tiny Qwen3-MoE's greedy continuation of the 5-token prompt reaches id 2).
    hf.generation_config.eos_token_id = None
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]  # a common prefix: prefix-cache hits
    prompts = [shared[:n] if n <= 20 else shared + [rng.randrange(3, VOCAB) for _ in range(n - 20)]
               for n in LENGTHS]
    refs = [hf_greedy(hf, ids, NEW) for ids in prompts]
    return name, str(path), prompts, refs, tokenizer_dir


def make_llm(family, **kw) -> LLM:
    _, path, _, _, tokenizer = family
    args = dict(model=path, tokenizer=tokenizer, dtype="float32", block_size=4, max_model_len=128,
                kv_cache_memory="4MiB", enable_chunked_prefill=True, max_num_batched_tokens=16,
                enable_prefix_caching=True, max_num_seqs=8)
    return LLM(**(args | kw))


def check(llm: LLM, family, outs, times: int = 1) -> None:
    name, _, _, refs, _ = family
    assert len(outs) == len(refs) * times
    for k, (out, (ref, top)) in enumerate(zip(outs, refs * times)):
        assert_matches(out.outputs[0].token_ids, ref, top, f"{name} prompt {k}")
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert not llm.engine.has_unfinished_requests() and bm.all_free(), "blocks leaked"


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_alone_batched_chunked_and_from_the_prefix_cache(family):
    llm = make_llm(family)
    prompts = family[2]
    alone = [llm.generate([ids], greedy())[0] for ids in prompts]
    check(llm, family, alone)
    batched = llm.generate(prompts, greedy())
    check(llm, family, batched)
    assert all(o.num_cached_tokens > 0 for o in batched[1:]), "the shared prefix was not served from the cache"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_under_preemption(family, mode):
    # 32 blocks of 4 tokens; the prompts twice over need 2 x (5+9+14+21) blocks at their ends.
    # NOTE: windowed layers give back all but a few blocks of a sequence (engine/core/kv_layout.py),
    # so these take a pool of one max_model_len (84 tokens: 21 blocks) per KV layer group, Mistral
    # one group of 3 layers, the Gemmas 3 of 1 (a full layer between two windowed ones).
    groups = {"mistral_swa": (24,), "gemma2": (None, 16, 16), "gemma3": (None, 24, 24)}.get(family[0], (None,))
    windowed = groups != (None,)
    llm = make_llm(family, num_gpu_blocks_override=21 * len(groups) if windowed else 32, preemption_mode=mode,
                   swap_space=0.01, enable_prefix_caching=False, **({"max_model_len": 84} if windowed else {}))
    outs = llm.generate(family[2] * 2, greedy())
    assert llm.engine.scheduler.num_preemptions[mode] > 0
    assert llm.engine.block_manager.windows == groups
    check(llm, family, outs, times=2)


def test_the_compiled_stack_gives_the_python_layers_floats(family):
    """Where the compiled decoder stack runs a family (Qwen3's per-head q/k norms included), every
    forward pass gives the Python layers' hidden states and cache bit for bit."""
    from engine.worker.models.decoder_stack import why_not
    from tests.engine.test_decoder_stack import run_both_ways

    name = family[0]
    llm = make_llm(family, linear_kernel="panels")
    runner = llm.engine.executor.runner
    reason = why_not(runner.model, runner.device, 1)
    if reason is not None:
        pytest.skip(f"{name}: the compiled stack does not run it ({reason})")
    engine = llm.engine
    seen = run_both_ways(engine)
    for k, ids in enumerate(family[2]):
        engine.add_request(str(k), ids, greedy())
    while engine.has_unfinished_requests():
        engine.step()
    assert any(p and d for p, d, _, _ in seen) and any(cached for *_, cached in seen)  # prompts beside decodes


def test_tensor_parallelism_refuses_a_hybrid_layout_in_one_line(family):
    """Only the KV layer group 0's table changes reach tensor-parallel workers: a hybrid model
    (several groups) with --tensor-parallel-size > 1 stops at start-up, before any worker."""
    if family[0] not in ("gemma2", "gemma3"):
        pytest.skip("one KV layer group")
    with pytest.raises(ValueError, match="tensor parallelism with sliding-window KV layer groups"):
        make_llm(family, tensor_parallel_size=2)
