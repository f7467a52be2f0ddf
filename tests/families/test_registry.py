"""The model registry: `--list-architectures`, one start-up line for an architecture or a config
field we do not serve, and a sliding window that no longer cuts the context."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.models.registry import ARCHITECTURES, UnsupportedModelError, check_config
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


def config_of(family: str):
    """The tiny model's config with its architecture named, as a saved config.json has it."""
    model = build(family)
    model.config.architectures = [type(model).__name__]
    return model.config


def test_a_sliding_window_no_longer_cuts_the_context():
    """Every family's attention honours its windows per layer (the families' equality tests run
    Mistral, Gemma 2 and Gemma 3 past theirs), so check_config serves the whole context asked."""
    for family in ("mistral_swa", "gemma2", "gemma3"):
        assert check_config(config_of(family), 128, max_model_len_asked=True) == 128
        assert check_config(config_of(family), 128, max_model_len_asked=False) == 128


@pytest.mark.parametrize("family,field,value,message", [
    ("gemma2", "hidden_activation", "relu", "hidden_activation 'relu' of Gemma2ForCausalLM is not one we compute"),
    ("gemma3", "use_bidirectional_attention", True, "use_bidirectional_attention true of Gemma3ForCausalLM"),
    ("gemma2", "attention_bias", True, "attention_bias true of Gemma2ForCausalLM"),
    ("gemma3", "layer_types", ["chunked_attention"] * 3, "layer_types chunked_attention of Gemma3ForCausalLM"),
])
def test_what_gemma_does_not_compute_is_refused_naming_the_field(family, field, value, message):
    config = config_of(family)
    setattr(config, field, value)
    with pytest.raises(UnsupportedModelError, match=message):
        check_config(config, 128, max_model_len_asked=False)


def test_a_rope_type_per_layer_type_is_checked():
    config = config_of("gemma3")
    config.rope_parameters["full_attention"] = {"rope_type": "spiral", "rope_theta": 1e6}
    with pytest.raises(UnsupportedModelError, match="rope_type 'spiral' of Gemma3ForCausalLM"):
        check_config(config, 128, max_model_len_asked=False)
