"""Sampling defaults from the model's `generation_config.json`, as vLLM's `--generation-config`:

- `auto` (the default): the model directory's generation_config.json, if it ships one;
- `vllm`: none (the server's own defaults: temperature 1, top_p 1, ...);
- a folder (or a file) path: the generation_config.json there.

A request that leaves a field out gets the model's value: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens. The defaults in force are
logged at start-up and shown in /v1/models.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.core.sampling_params import SamplingParams

# generation_config.json field -> request field (the fields vLLM takes from it)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(setting: str, model_path: str) -> tuple[dict, str | None]:
    """(the defaults, the file they came from). Raises ValueError for a path that has no
    generation_config.json, or values a request could not carry."""
    if setting == "vllm":
        return {}, None
    if setting == "auto":
        base = Path(model_path)
        if not base.is_dir():  # a dummy-weights config, or a file: nothing ships with it
            return {}, None
        file = base / "generation_config.json"
        if not file.is_file():
            return {}, None
    else:
        base = Path(setting).expanduser()
        file = base / "generation_config.json" if base.is_dir() else base
        if not file.is_file():
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    defaults = {ours: data[theirs] for theirs, ours in FIELDS.items() if data.get(theirs) is not None}
    try:  # the same checks a request's own values get
        SamplingParams(**{k: v for k, v in defaults.items() if k != "max_tokens"},
                       max_tokens=defaults.get("max_tokens", 16))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from None
    return defaults, str(file)
