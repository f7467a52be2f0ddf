"""Pipeline parallelism on the CPU (gloo): greedy tokens equal HF transformers' with P=3 and
P=2 x T=2, under swap and recompute preemption, prefills chunked into steps that mix them with
decodes (so micro-batches hold both); the same tokens as one process with P=2 on the dummy
tiny-4kv with every kind of block move and prompt logprobs; each rank holding its stage's
layers and KV only; clear errors at start-up; a dead stage failing the engine within a bounded
time (the daemon's /health: test_server_pp.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.multiprocessing as mp

from engine.core.sampling_params import SamplingParams
from engine.core.step import SeqInput
from engine.worker.executor import WorkerDiedError, _free_port
from engine.worker.parallel import stage_layers
from engine.worker.pipeline_stage import micro_batches
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.parallel.conftest import check_a_stopped_worker_fails_the_step, run_until_failure, start_long_requests, tp_llm
from tests.parallel.test_tensor_parallel import TINY, compare, greedy

NEW = 10


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(model dir, tokenizer dir, prompts, HF references) of a 3-layer Llama with 2 KV heads."""
    from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
    from tests.families.tiny_models import VOCAB, build, save

    hf = build("llama")
    path = save(hf, tmp_path_factory.mktemp("llama"))
    hf.generation_config.eos_token_id = None
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 41, 70)]
    refs = [hf_greedy(hf, ids, NEW) for ids in prompts]
    return str(path), str(gguf_tokenizer_dir(default_gguf_path())), prompts, refs


def run_against_hf(tiny_llama, **kw) -> None:
    path, tokenizer, prompts, refs = tiny_llama
    args = dict(model=path, tokenizer=tokenizer, dtype="float32", block_size=4, max_model_len=128,
                kv_cache_memory="4MiB", swap_space=0.01, enable_chunked_prefill=True, max_num_batched_tokens=16,
                enable_prefix_caching=False, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    with tp_llm(**(args | kw)) as llm:
        outs = llm.generate(prompts * 2, params)
        mode = args.get("preemption_mode") or kw.get("preemption_mode")
        if mode:
            assert llm.engine.scheduler.num_preemptions[mode] > 0, "the pool was meant to preempt"
        bm = llm.engine.block_manager
        bm.check_integrity()
        assert bm.all_free(), "blocks leaked"
    for k, (out, (ref, top)) in enumerate(zip(outs, refs * 2)):
        assert_matches(out.outputs[0].token_ids, ref, top, f"{kw} prompt {k}")


def test_stages_split_the_layers_contiguously_and_micro_batches_keep_order():
    assert [stage_layers(4, 3, s) for s in range(3)] == [range(0, 1), range(1, 2), range(2, 4)]
    assert [stage_layers(30, 4, s) for s in range(4)] == [range(0, 7), range(7, 14), range(14, 22), range(22, 30)]
    seqs = [SeqInput([1] * n, 0, [], n > 1, seq_id=i)
            for i, n in enumerate((40, 1, 1, 1, 1, 1))]
    groups = micro_batches(seqs, 2)
    assert [[s.seq_id for s in g] for g in groups] == [[0], [1, 2, 3, 4, 5]]
    assert [[s.seq_id for s in g] for g in micro_batches(seqs[1:], 2)] == [[1, 2, 3], [4, 5]]
    assert len(micro_batches(seqs[:1], 3)) == 1


def test_a_stage_without_a_layer_fails_clearly_at_start():
    from engine.loop.llm import LLM

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 leaves a stage without a decoder layer.*has 4"):
        LLM(**TINY, pipeline_parallel_size=5)
    assert time.monotonic() - t0 < 30
    assert not [p for p in mp.active_children() if p.name.startswith("tp-worker")]


@pytest.mark.timeout(120)
def test_pp3_equals_hf_under_swap_preemption(tiny_llama):
    # NOTE: 32 blocks of 4 tokens; the 8 prompts at their ends need 2 x (4+9+13+20): it preempts
    run_against_hf(tiny_llama, pipeline_parallel_size=3, num_gpu_blocks_override=32, preemption_mode="swap")


@pytest.mark.timeout(120)
def test_pp2_without_micro_batches_equals_hf_under_recompute_preemption(tiny_llama):
    run_against_hf(tiny_llama, pipeline_parallel_size=2, pipeline_micro_batches=1, num_gpu_blocks_override=32,
                   preemption_mode="recompute")


@pytest.mark.timeout(150)
def test_pp2_by_tp2_equals_hf(tiny_llama):
    run_against_hf(tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=2, num_gpu_blocks_override=32)


@pytest.mark.timeout(120)
def test_tiny_4kv_pp2_equals_pp1_with_swaps_copies_and_prompt_logprobs():
    """Dummy weights are seeded per parameter name, so each stage draws P=1's values for its
    own and P=2 must give P=1's tokens; a pool
    small enough to swap and n=2 forks that copy-on-write run every block move on both stages;
    prompt logprobs come back from the last stage with the micro-batches' wanted rows."""
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(30 + 9 * i)] for i in range(4)]
    params = [greedy(24, ignore_eos=True)] * 2 + [greedy(24, ignore_eos=True, n=2),
                                                  greedy(4, ignore_eos=True, prompt_logprobs=2)]
    args = dict(TINY, num_gpu_blocks_override=12)
    with tp_llm(**args) as llm:
        reference = llm.generate(prompts, params)
        swaps = llm.engine.scheduler.swapped_blocks["out"]
        full_bytes = llm.engine.executor.weights_bytes
        full_block = llm.engine.cache.bytes_per_block
    with tp_llm(**args, pipeline_parallel_size=2) as llm:
        # stage 0: the embedding, 2 of 4 layers and the LM head (of the 4 layers' weights)
        assert llm.engine.executor.weights_bytes < 0.8 * full_bytes
        assert llm.engine.cache.bytes_per_block * 2 == full_block, "stage 0's KV pool holds its 2 layers"
        ours = llm.generate(prompts, params)
        assert llm.engine.scheduler.swapped_blocks["out"] == swaps > 0
        llm.engine.block_manager.check_integrity()
    compare(ours, reference, "tiny-4kv PP=2")
    got, want = ours[3].prompt_logprobs, reference[3].prompt_logprobs
    for i, tok in enumerate(prompts[3][1:], start=1):
        assert got[i][tok].logprob == pytest.approx(want[i][tok].logprob, abs=1e-4), i


@pytest.mark.timeout(90)
def test_dead_stage_fails_the_engine_cleanly():
    with tp_llm(**TINY, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        start_long_requests(engine)
        pid = engine.executor._procs[1].pid
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()  # lands mid-step, in a send or receive
        err, took = run_until_failure(engine, 30)
        assert isinstance(err, WorkerDiedError) and "rank 1 (pipeline stage 1)" in str(err), err
        assert "SIGKILL" in str(err) and took < 10
        with pytest.raises(WorkerDiedError):
            engine.step()


def _external_worker(rank: int, world: int, code: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), PAGED_SERVE_DEVICE="cpu")
    args = ["-c", code] if code else ["-m", "engine.worker.tp_worker"]
    return subprocess.Popen([sys.executable, *args], env=env)


@pytest.mark.timeout(120)
def test_stage_from_elsewhere_joins_through_env_rendezvous(monkeypatch):
    """Stage 1 as `python -m engine.worker.tp_worker` from another machine would start it."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("PAGED_SERVE_TP_LOCAL_WORKERS", "0")
    prompts = [[11, 12, 13, 14], [500] * 33]
    with tp_llm(**TINY) as llm:
        reference = llm.generate(prompts, greedy(12))
    worker = _external_worker(1, 2)
    try:
        with tp_llm(**TINY, pipeline_parallel_size=2) as llm:
            ours = llm.generate(prompts, greedy(12))
        compare(ours, reference, "env:// stage")
        assert worker.wait(timeout=20) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_model_fail_clearly_at_start(monkeypatch):
    """A worker that sees other model files at the model's path (another checkpoint on its
    machine) is refused before anyone loads weights, on both sides."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("PAGED_SERVE_TP_LOCAL_WORKERS", "0")
    code = ("import engine.worker.tp_worker as w; "
            "w.model_fingerprint = lambda mc: ('another model', 1, 2, 3, ()); w.main()")
    worker = _external_worker(1, 2, code)
    try:
        from engine.loop.llm import LLM

        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank\\(s\\) 1 disagree with rank 0 on the model"):
            LLM(**TINY, pipeline_parallel_size=2)
        assert time.monotonic() - t0 < 60
        assert worker.wait(timeout=20) != 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.timeout(90)
def test_hung_stage_fails_the_step_after_the_timeout(monkeypatch):
    """A stage that stops answering leaves the others waiting in a receive, which gives up
    after PAGED_SERVE_TP_TIMEOUT as a collective does."""
    check_a_stopped_worker_fails_the_step(monkeypatch, **TINY, pipeline_parallel_size=2)
