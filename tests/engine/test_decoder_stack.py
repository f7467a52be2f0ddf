"""The compiled decoder stack (engine/worker/models/decoder_stack.py over cuda_ext/csrc/cpu/
decoder_stack.cpp) gives the Python layers' floats bit for bit: every forward pass of seeded
random workloads on the tiny dummy model (prompt chunks with and without a cached prefix beside
decodes, prompt logprobs' extra rows, parallel samples' copy-on-write, q/k/v biases) runs both
ways from the same caches, and the hidden states and the K/V written must be equal. Where it
does not apply, the layers run in Python and the log says why; its arguments are checked."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from cuda_ext import ops
from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine
from engine.worker.models import decoder_stack, linear_kernel

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (ops.backend() == "cpu" and ops.decoder_stack_available()),
    reason="the compiled stack needs the compiled CPU ops built for a CPU with AVX2 and FMA",
)


def tiny_engine(tmp_path: Path, bias: bool = False, **kwargs) -> LLMEngine:
    config = json.loads((REPO / "configs/models/tiny-4kv.json").read_text())
    if bias:  # biases on q/k/v only: Qwen2's (Llama's attention_bias puts one on o_proj too)
        config |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    args = dict(model=str(path), load_format="dummy", dtype="float32", linear_kernel="panels", max_model_len=512,
                kv_cache_memory="8MiB", max_num_batched_tokens=96, enable_prefix_caching=True)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args).create_engine_config())


def run_both_ways(engine: LLMEngine) -> list[tuple]:
    """Make every forward pass run the Python layers, then (from the same caches) the compiled
    stack, asserting equal outputs and caches; returns per pass (prompt tokens, decodes, rows
    cut, a chunk after a cached prefix)."""
    model = engine.executor.runner.model
    decoder = model.model
    stack = decoder.compiled_stack
    assert stack is not None
    forward = model.forward
    seen = []

    def both(input_ids, positions, meta, kv_caches, rows=None):
        before = [(k.clone(), v.clone()) for k, v in kv_caches]
        decoder.compiled_stack = None
        want = forward(input_ids, positions, meta, kv_caches, rows)
        want_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        for (k, v), (k0, v0) in zip(kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        decoder.compiled_stack = stack
        got = forward(input_ids, positions, meta, kv_caches, rows)
        assert torch.equal(got, want)
        assert all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(kv_caches, want_caches))
        P = meta.num_prefill_tokens
        seen.append((P, input_ids.shape[0] - P, rows is not None, any(s.num_cached for s in meta.prefills)))
        return got

    model.forward = both
    return seen


def onednn_case(dtype: str):
    """(dtype, "onednn") as a parameter, skipped where oneDNN does not pack that dtype here."""
    here = linear_kernel.onednn_supported(torch.device("cpu"), getattr(torch, dtype))
    return pytest.param(dtype, "onednn", marks=pytest.mark.skipif(not here, reason=f"oneDNN packs no {dtype} here"))


@pytest.mark.parametrize(("dtype", "kernel"), [("float32", "panels"), onednn_case("bfloat16"),
                                               onednn_case("float32")])
@pytest.mark.parametrize(("seed", "bias"), [(0, False), (1, False), (2, True)])
def test_the_stack_gives_the_python_layers_floats(tmp_path, seed, bias, dtype, kernel):
    engine = tiny_engine(tmp_path, bias, dtype=dtype, linear_kernel=kernel)
    runner = engine.executor.runner
    assert runner.linear_kernel == kernel and runner.model.model.norm.weight.dtype == getattr(torch, dtype)
    seen = run_both_ways(engine)
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(40)]  # a prefix some prompts share
    for i in range(24):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 200))]
        if rng.random() < 0.3:
            prompt = shared + prompt
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 12), ignore_eos=True,
                                seed=i, n=rng.choice([1, 1, 2]), prompt_logprobs=rng.choice([None, None, 2]))
        engine.add_request(f"r{i}", prompt, params)
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_integrity()
    assert any(p and d for p, d, _, _ in seen), "no step mixed prompt chunks with decodes"
    assert any(cut for _, _, cut, _ in seen), "no step cut the rows past the last attention"
    assert any(cached for *_, cached in seen), "no chunk followed a cached prefix"
    assert any(p == 0 for p, *_ in seen), "no step of decodes alone"


def test_a_window_all_layers_share_runs_in_the_stack_past_it(tmp_path):
    """Mistral's one sliding window on every layer: the kernels compute it, so the stack runs
    the steps whose contexts outgrow it too, with the Python layers' floats."""
    config = json.loads((REPO / "configs/models/tiny-4kv.json").read_text())
    config |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 16}
    (tmp_path / "swa.json").write_text(json.dumps(config))
    engine = tiny_engine(tmp_path, model=str(tmp_path / "swa.json"))
    stack = engine.executor.runner.model.model.compiled_stack
    assert stack is not None and stack.window == 16 and stack.shared_window
    applied = []  # (the step's longest context, whether the stack ran it)
    applies = stack.applies

    def record(meta, kv_caches):
        applied.append((meta.max_context_len, applies(meta, kv_caches)))
        return applied[-1][1]

    object.__setattr__(stack, "applies", record)  # a frozen dataclass
    seen = run_both_ways(engine)
    rng = random.Random(3)
    for i in range(6):
        engine.add_request(f"r{i}", [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 60))],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(p and d for p, d, _, _ in seen)
    assert all(ran for _, ran in applied) and max(n for n, _ in applied) > 16


def test_where_it_does_not_apply_the_layers_run_in_python(tmp_path, caplog):
    caplog.set_level("INFO", logger="engine.worker.model_runner")
    for kwargs, why in (({"fused_ops": False}, "turned off"), ({"linear_kernel": "torch"}, "panels kernel"),
                        ({"dtype": "float16", "linear_kernel": "torch"}, "float32 or bfloat16")):
        engine = tiny_engine(tmp_path, **kwargs)
        assert engine.executor.runner.model.model.compiled_stack is None
        assert any("decoder layers: layer by layer" in r.message and why in r.message for r in caplog.records), why
        caplog.clear()
    engine = tiny_engine(tmp_path)
    assert engine.executor.runner.model.model.compiled_stack is not None
    assert any("decoder layers: one compiled call" in r.message for r in caplog.records)
    config = json.loads((REPO / "configs/models/tiny-4kv.json").read_text())
    config["head_dim"] = 24  # the prefill kernel takes multiples of 16
    (tmp_path / "h24.json").write_text(json.dumps(config))
    engine = tiny_engine(tmp_path, model=str(tmp_path / "h24.json"))
    model = engine.executor.runner.model
    assert model.model.compiled_stack is None
    assert "head size 24" in decoder_stack.why_not(model, torch.device("cpu"), 1)
    engine.add_request("a", list(range(10, 50)), SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].outputs[0].token_ids) == 4  # the Python layers serve it


def captured_call(tmp_path) -> tuple:
    """The arguments of one real ops.decoder_stack call (a prompt beside a decode)."""
    engine = tiny_engine(tmp_path)
    calls = []
    real = ops.decoder_stack

    def record(*args):
        calls.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return real(*args)

    ops.decoder_stack = record
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()
        engine.add_request("b", list(range(10, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
    finally:
        ops.decoder_stack = real
    while engine.has_unfinished_requests():
        engine.step()
    return calls[-1]


def test_opcheck_and_refused_arguments(tmp_path):
    args = captured_call(tmp_path)
    lib = ops.compiled_library()
    as_op = list(args)
    for i in (2, 3, 4, 8, 9):  # tuples of tensors as lists
        as_op[i] = list(as_op[i])
    torch.library.opcheck(lib.decoder_stack.default, tuple(as_op))
    bad = list(as_op)
    bad[2] = bad[2][:-1]  # a weight short
    with pytest.raises(RuntimeError, match="6 weights and a key and a value cache per layer"):
        lib.decoder_stack(*bad)
    bad = list(as_op)
    bad[13] = bad[0].shape[0] + 1  # more prompt tokens than tokens
    with pytest.raises(RuntimeError, match="num_prefill_tokens"):
        lib.decoder_stack(*bad)
    bad = list(as_op)
    bad[4] = [bad[5]]  # one q/k norm for two layers
    with pytest.raises(RuntimeError, match="qk_norms must be empty or two per layer"):
        lib.decoder_stack(*bad)
