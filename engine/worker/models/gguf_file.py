"""One GGUF file, read in place: its metadata as a model config, its tensors checked
against their types and shapes, and their bytes as stored (memory-mapped, never copied here).

Everything wrong with a file surfaces as one `GGUFError` naming the file, the tensor (if one is
at fault) and the reason, when the file is opened or its config is built, before any weight is
read: a cut-short header or data section, a tensor whose bytes overlap the next one or run past
the end of the file, a type or shape that cannot hold whole blocks, an unknown architecture, a
missing tensor or metadata key, a shape the metadata does not imply.

Shapes here are PyTorch's ([rows, K]: GGUF lists its dimensions the other way round); a
quantized tensor's bytes are [rows, row_bytes], whole blocks per row.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from engine.worker.models.gguf_layout import (
    ARCHITECTURES,
    CONFIG_CLASSES,
    family_fields,
    split_experts,
    tensor_shapes,
)

_SHORT_ARRAY = 256  # metadata arrays longer than this are read in one piece (or stepped over)


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message is one line: file, tensor, reason."""

    def __init__(self, path: str | os.PathLike, reason: str, tensor: str | None = None):
        where = f"{path}: tensor {tensor}: " if tensor else f"{path}: "
        super().__init__(where + reason)
        self.path, self.tensor, self.reason = str(path), tensor, reason


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: str  # ggml's type name in lower case: "q4_1", "q6_k", "f16", "f32", "iq4_xs", ...
    shape: tuple[int, ...]  # PyTorch order
    offset: int  # from the start of the file
    nbytes: int


def _reader_class():
    import gguf

    class CheckedReader(gguf.GGUFReader):
        """gguf's reader, with each tensor checked against the file before gguf maps it (where a
        cut-short file would end in a numpy reshape error)."""

        def __init__(self, path: Path):
            self._path = path
            super().__init__(path, "r")

        def _get_field_parts(self, orig_offs, raw_type):
            """gguf's field parsing, except for long arrays (the tokenizer's vocabulary, merges
            and scores): numbers come as one array part, strings are stepped over and read as
            empty. NOTE: gguf makes one numpy array per element, ~4 s and ~150 MB for a 49k
            vocabulary (a 128k one is several times that); transformers reads the tokenizer."""
            if raw_type != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            if len(count) < 1 or count[0] <= _SHORT_ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            n, sub = int(count[0]), gguf.GGUFValueType(int(item[0]))
            offs = orig_offs + 12
            if sub == gguf.GGUFValueType.STRING:
                data, order = memoryview(self.data), ">Q" if self.byte_order == "S" else "<Q"
                for _ in range(n):
                    offs += 8 + struct.unpack_from(order, data, offs)[0]
                return offs - orig_offs, [item, count], [], [gguf.GGUFValueType.ARRAY, sub]
            values = self._get(offs, self.gguf_scalar_to_np[sub], n)
            return 12 + values.nbytes, [item, count, values], [2], [gguf.GGUFValueType.ARRAY, sub]

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            spans = []
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise GGUFError(self._path, f"unknown tensor type id {int(raw_type[0])}", name) from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                shape = [int(d) for d in dims]
                if shape and shape[0] % block:
                    raise GGUFError(self._path, f"rows of {shape[0]} values are not whole {qtype.name} blocks "
                                                f"of {block}", name)
                nbytes = math.prod(shape) // block * type_size
                start = int(start_offs) + int(offset[0])
                if start % self.alignment:
                    raise GGUFError(self._path, f"data offset {start} is not aligned to {self.alignment} bytes", name)
                if start + nbytes > size:
                    have = max(size - start, 0)
                    raise GGUFError(self._path, f"{qtype.name} {shape[::-1]} needs {nbytes} bytes but the file ends "
                                                f"{have} bytes into it (truncated file?)", name)
                spans.append((start, nbytes, name, qtype.name, shape))
            spans.sort()
            for (start, nbytes, name, tname, shape), nxt in zip(spans, spans[1:]):
                if start + nbytes > nxt[0]:
                    raise GGUFError(self._path, f"{tname} {shape[::-1]} needs {nbytes} bytes but tensor {nxt[2]} "
                                                f"starts {nxt[0] - start} bytes after it: its byte size disagrees "
                                                "with its type and shape", name)
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class GGUFConfig(SimpleNamespace):
    """A GGUF model's config: the attributes its transformers config class would have, set from
    the file's metadata (every one the engine reads is given, so no class defaults are needed).

    NOTE: a plain object, not a transformers PretrainedConfig: importing transformers' config
    classes pulls in its modelling and distributed modules (sympy, torch.distributed.tensor,
    accelerate), ~86 MB of resident memory, more than the 135M default model's quantized weights.
    `to_transformers()` builds the real class where one is needed (rope scaling initialisers).
    """

    def to_dict(self) -> dict:
        return dict(vars(self))

    def to_transformers(self):
        import transformers

        kwargs = self.to_dict()
        return getattr(transformers, CONFIG_CLASSES[kwargs.pop("model_type")])(**kwargs)


class GGUFFile:
    """A GGUF file's metadata and tensors. Open with `GGUFFile.open` (one file is kept open per
    process between the config and the weights: parsing a large vocabulary takes seconds);
    `close` when the weights are in."""

    _open: dict[tuple, GGUFFile] = {}

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._reader = _reader_class()(self.path)
        except GGUFError:
            raise
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as e:
            reason = "not a GGUF file (bad magic)" if "magic" in str(e) else \
                f"unreadable GGUF header, cut short or corrupt ({type(e).__name__}: {e})"
            raise GGUFError(self.path, reason) from None
        self._data = {t.name: t.data for t in self._reader.tensors}
        self.tensors = {
            t.name: TensorInfo(t.name, t.tensor_type.name.lower(), tuple(int(d) for d in reversed(t.shape.tolist())),
                               t.data_offset, t.n_bytes)
            for t in self._reader.tensors
        }
        self.arch = self.value("general.architecture")

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        p = Path(path).resolve()
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in cls._open:
            cls._open.clear()
            cls._open[key] = cls(p)
        return cls._open[key]

    def close(self) -> None:
        """Unmap the file (once nothing else holds a view of it)."""
        for key, f in list(self._open.items()):
            if f is self:
                del self._open[key]
        self._data.clear()
        self._reader = None

    # ------------------------------------------------------------------ metadata

    def value(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def need(self, key: str):
        value = self.value(key)
        if value is None:
            raise GGUFError(self.path, f"metadata key {key} is missing")
        return value

    def hf_config(self) -> GGUFConfig:
        """The model's config (the attributes of a transformers LlamaConfig / Qwen2Config), after
        checking that every tensor the model needs is here with the shape the metadata implies."""
        a = self.arch
        if a not in ARCHITECTURES:
            raise GGUFError(self.path, f"architecture {a!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        hidden, heads = int(self.need(f"{a}.embedding_length")), int(self.need(f"{a}.attention.head_count"))
        kv_heads = self.value(f"{a}.attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per layer: we serve one value for all
            if len(set(kv_heads)) != 1:
                raise GGUFError(self.path, f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
            kv_heads = kv_heads[0]
        head_dim = int(self.value(f"{a}.attention.key_length", hidden // heads))
        rotary_dim = int(self.value(f"{a}.rope.dimension_count", head_dim))
        if rotary_dim != head_dim and a != "phi3":
            raise GGUFError(self.path, f"partial rotary ({rotary_dim} of {head_dim} head dimensions) is not supported")
        embed = self.tensors.get("token_embd.weight")
        vocab = embed.shape[0] if embed is not None else int(self.need(f"{a}.vocab_size"))
        kwargs = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(self.need(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self.need(f"{a}.block_count")), num_attention_heads=heads,
            num_key_value_heads=int(kv_heads), head_dim=head_dim, hidden_act="silu",
            max_position_embeddings=int(self.value(f"{a}.context_length", 2048)),
            rms_norm_eps=float(self.value(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_parameters=self._rope_parameters(rotary_dim),
            tie_word_embeddings="output.weight" not in self.tensors,
            # NOTE: HF's meaning: biases on q/k/v and o (Llama's); Qwen2's q/k/v biases go without
            # it (its class has them always, and no o_proj bias)
            attention_bias=a != "qwen2" and "blk.0.attn_q.bias" in self.tensors,
            bos_token_id=self.value("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.value("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.value("tokenizer.ggml.padding_token_id"),
            architectures=[ARCHITECTURES[a]],
        )
        if rotary_dim != head_dim:
            kwargs["partial_rotary_factor"] = rotary_dim / head_dim
        config = GGUFConfig(**(kwargs | family_fields(self, kwargs)))
        self._check_tensors(config)
        return config

    def _rope_parameters(self, rotary_dim: int) -> dict:
        a = self.arch
        theta = float(self.value(f"{a}.rope.freq_base", 10000.0))
        params = {"rope_type": "default", "rope_theta": theta}
        kind = self.value(f"{a}.rope.scaling.type")
        factor = self.value(f"{a}.rope.scaling.factor")
        if "rope_freqs.weight" in self.tensors:
            found = _llama3_rope(self.dense("rope_freqs.weight"), theta, rotary_dim)
            if found is None:
                raise GGUFError(self.path, "frequency factors other than Llama 3's rope scaling are not supported",
                                "rope_freqs.weight")
            return params | found
        if "rope_factors_long.weight" in self.tensors:
            return params | self._longrope(rotary_dim)
        if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
            return params
        if kind == "linear":
            return params | {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            orig = self.need(f"{a}.rope.scaling.original_context_length")
            return params | {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig)}
        raise GGUFError(self.path, f"rope scaling {kind!r} is not supported")

    def _longrope(self, rotary_dim: int) -> dict:
        """HF's longrope parameters from Phi-3's rope_factors_long / _short tensors and the
        attention factor convert_hf_to_gguf.py wrote beside them."""
        a, factors = self.arch, {}
        for kind in ("long", "short"):
            name = f"rope_factors_{kind}.weight"
            if name not in self.tensors:
                raise GGUFError(self.path, "missing (longrope needs both factor tensors)", name)
            t = self.dense(name).reshape(-1)
            if t.numel() != rotary_dim // 2:
                raise GGUFError(self.path, f"{t.numel()} factors for a rotary dimension of {rotary_dim}", name)
            factors[f"{kind}_factor"] = t.tolist()
        orig = int(self.need(f"{a}.rope.scaling.original_context_length"))
        params = {"rope_type": "longrope", "original_max_position_embeddings": orig} | factors
        attn = self.value(f"{a}.rope.scaling.attn_factor")
        return params if attn is None else params | {"attention_factor": float(attn)}

    def _check_tensors(self, config) -> None:
        want = tensor_shapes(config, self.arch, split_experts(self.tensors))
        for name, shape in want.items():
            info = self.tensors.get(name)
            if info is None:
                raise GGUFError(self.path, f"missing (a {self.arch} model of {config.num_hidden_layers} layers "
                                           "needs it)", name)
            if info.shape != shape:
                raise GGUFError(self.path, f"shape {list(info.shape)} where the metadata implies {list(shape)}", name)

    # ------------------------------------------------------------------ tensors

    def _stored(self, name: str, expert: int | None) -> np.ndarray:
        """The tensor's array as gguf maps it; with `expert`, that expert's 2-D slice of a 3-D
        tensor [experts, rows, K] (its last dimension: values, or a quantized row's bytes)."""
        data = self._data[name]
        if expert is None:
            return data
        shape = self.tensors[name].shape
        return data.reshape(shape[0], shape[1], -1)[expert]

    def raw(self, name: str, expert: int | None = None) -> np.ndarray:
        """A tensor's bytes as stored, uint8 [rows, row_bytes] (a view of the file); with
        `expert`, that expert's rows of a 3-D tensor."""
        data = self._stored(name, expert)
        rows = self.tensors[name].shape[0 if expert is None else 1]
        return data.reshape(rows, -1) if data.dtype == np.uint8 else data.view(np.uint8).reshape(rows, -1)

    def dense(self, name: str, expert: int | None = None) -> torch.Tensor:
        """A tensor dequantized to float32 (a copy), in its PyTorch shape (with `expert`: that
        expert's 2-D slice of a 3-D tensor)."""
        import gguf

        info = self.tensors[name]
        try:
            values = gguf.quants.dequantize(self._stored(name, expert), gguf.GGMLQuantizationType[info.qtype.upper()])
        except NotImplementedError:
            raise GGUFError(self.path, f"type {info.qtype.upper()} cannot be dequantized by gguf-py "
                                       f"{_version('gguf')}", name) from None
        shape = info.shape if expert is None else info.shape[1:]
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's memory (they stay in the page cache), once
        its bytes have been copied: so loading holds one tensor of the file at a time."""
        info, mm = self.tensors[name], getattr(self._reader.data, "_mmap", None)
        page = mmap.PAGESIZE
        start, end = -(-info.offset // page) * page, (info.offset + info.nbytes) // page * page
        if mm is None or end <= start or not hasattr(mm, "madvise"):
            return
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError, AttributeError):  # not Linux: the pages go with the mapping
            pass


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _llama3_rope(factors: torch.Tensor, theta: float, head_dim: int) -> dict | None:
    """HF's llama3 rope parameters if `factors` (rope_freqs.weight) are what convert_hf_to_gguf.py
    writes for them (Llama 3.1-3.3: low / high frequency factors 1 and 4 over 8,192 positions)."""
    factor, low, high, old = float(factors.max()), 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    want = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            want.append(1.0)
        elif wavelen > old / low:
            want.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            want.append(1 / ((1 - smooth) / factor + smooth))
    if factors.numel() != len(want) or not torch.allclose(factors.float(), torch.tensor(want), rtol=1e-4):
        return None
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}
