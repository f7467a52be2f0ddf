"""The model registry: `--list-architectures`, one start-up line for an architecture or a config
field we do not serve, and a sliding window honoured by serving within one window."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.loop.llm import LLM
from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir
from engine.worker.models.registry import ARCHITECTURES, UnsupportedModelError, check_config
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equality import assert_matches
from tests.families.tiny_models import build, save

REPO = Path(__file__).resolve().parents[2]


def test_list_architectures_prints_each_registered_name_and_exits_0():
    run = subprocess.run([sys.executable, "-m", "server", "--list-architectures"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    names = [line.split()[0] for line in run.stdout.splitlines()]
    assert names == sorted(ARCHITECTURES) and "Qwen3ForCausalLM" in names
    assert all(line.split()[1].startswith("engine.worker.models.") for line in run.stdout.splitlines())


def test_an_unsupported_architecture_stops_start_up_with_one_line(tmp_path):
    import json

    path = save(build("llama"), tmp_path / "falcon")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "server", str(path), "--port", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert "Traceback" not in run.stderr and len(errors) == 2, run.stderr[-2000:]
    assert errors[0].endswith("The engine failed to load: unsupported architecture FalconForCausalLM; supported: "
                              + ", ".join(sorted(ARCHITECTURES)) + " (paged-serve --list-architectures)")


def test_an_unknown_rope_type_is_refused_naming_it():
    config = build("llama").config
    config.rope_parameters = {"rope_type": "spiral", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="rope_type 'spiral' of LlamaForCausalLM is not one we compute"):
        check_config(config, 128, max_model_len_asked=False)


def test_a_sliding_window_is_served_within_one_window(tmp_path):
    """Mistral with a 24-token window: the context is cut to the window (where attending to
    every earlier token is the window's attention) and greedy output equals HF's there; a longer
    --max-model-len is refused naming the field. Qwen's window is off unless use_sliding_window."""
    hf = build("mistral", sliding_window=24)
    path = save(hf, tmp_path / "mistral")
    tokenizer = str(gguf_tokenizer_dir(default_gguf_path()))
    with pytest.raises(UnsupportedModelError, match="max_model_len 128 exceeds the model's sliding_window 24"):
        LLM(model=str(path), tokenizer=tokenizer, dtype="float32", max_model_len=128)
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16)
    assert llm.engine.config.model.max_model_len == 24
    prompts = [[5 + 7 * i for i in range(n)] for n in (3, 12, 17)]
    for ids in prompts:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24 - len(ids), ignore_eos=True))[0]
        ref, top = hf_greedy(hf, ids, 24 - len(ids))
        assert_matches(out.outputs[0].token_ids, ref, top, f"{len(ids)}-token prompt")
    qwen = build("qwen2", sliding_window=24).config
    assert check_config(qwen, 128, max_model_len_asked=True) == 128  # use_sliding_window is False
