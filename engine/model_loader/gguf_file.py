"""Reading a GGUF file as a Hugging Face checkpoint: its config and its HF-named float tensors.

A small reader of our own (header, metadata, tensor table, memory-mapped data) keeps start-up
fast: the big string arrays (vocabulary, merges) are skipped, not decoded. With ``keep_blocks``
(the CPU, kernels built, no ``--quantization``), the 2-D tensors in the block formats the CPU
kernels multiply (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) come as ``GGUFTensor`` views of the mapped file,
kept as stored (engine/layers/gguf_linear.py); every other tensor is dequantized: the common
block formats (Q4_0, Q4_1, Q8_0) with vectorised torch ops, the others through the ``gguf``
package's reference ``dequantize``.

llama.cpp stores Llama's q and k projections with the rows of each head interleaved for its
GPT-J style rotary; ``hf_tensors`` undoes that so the model keeps Hugging Face's rotate-half form.
What each architecture's metadata and tensors mean, and which are refused: gguf_families.py.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.layers.gguf_linear import GGUFTensor, release_pages
from kvserve.engine.model_loader import gguf_families
from kvserve.kernels.cpu.kquant import BLOCK_TYPES

# metadata value types of fixed width: struct format and size
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34)}  # type: (values per block, bytes per block)

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    ggml_type: int
    offset: int  # from the start of the data section


class GGUFFile:
    """A GGUF file's metadata (scalars and strings; string arrays only counted) and tensors."""

    def __init__(self, path: str):
        self.path = path
        # copy-on-write: tensors kept as stored are views of these pages, never written
        self._data = np.memmap(path, dtype=np.uint8, mode="c")
        self._pos = 0
        if bytes(self._data[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, tensor_count, kv_count = self._unpack("<IQQ", 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
        self.metadata = dict(self._read_pair() for _ in range(kv_count))
        self.tensors = {info.name: info for info in (self._read_tensor_info() for _ in range(tensor_count))}
        alignment = self.metadata.get("general.alignment", 32)
        self._data_start = -(-self._pos // alignment) * alignment

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32 (float16/bfloat16 tensors keep their type)."""
        info = self.tensors[name]
        count = int(np.prod(info.shape))
        start = self._data_start + info.offset
        if info.ggml_type in _FLOAT_TYPES:
            dtype = _FLOAT_TYPES[info.ggml_type]
            raw = np.array(self._data[start : start + count * dtype.itemsize])
            return torch.from_numpy(raw).view(dtype).reshape(info.shape)
        values = _dequantize(self._block_bytes(info, start), info.ggml_type)
        return values.reshape(info.shape)

    def blocks(self, name: str) -> GGUFTensor:
        """A 2-D tensor in a format of ``BLOCK_TYPES`` as stored: a view of the mapped file."""
        info = self.tensors[name]
        rows, width = info.shape
        values, size = BLOCK_TYPES[info.ggml_type]
        start = self._data_start + info.offset
        data = torch.from_numpy(self._data[start : start + rows * (width // values) * size])
        return GGUFTensor(data.view(rows, -1), info.ggml_type, (rows, width), mapped=True)

    def _block_bytes(self, info: TensorInfo, start: int) -> np.ndarray:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        values_per_block, bytes_per_block = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        blocks = int(np.prod(info.shape)) // values_per_block
        return np.array(self._data[start : start + blocks * bytes_per_block]).reshape(blocks, bytes_per_block)

    # -- parsing -------------------------------------------------------------------------
    def _unpack(self, fmt: str, pos: int | None = None):
        pos = self._pos if pos is None else pos
        values = struct.unpack_from(fmt, self._data, pos)
        self._pos = pos + struct.calcsize(fmt)
        return values

    def _read_string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._data[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _read_pair(self) -> tuple[str, object]:
        key = self._read_string()
        (value_type,) = self._unpack("<I")
        return key, self._read_value(value_type)

    def _read_value(self, value_type: int):
        if value_type in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self._read_string()
        if value_type != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        item_type, count = self._unpack("<IQ")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            values = self._unpack(f"<{count}{fmt[1]}")
            return list(values) if count <= 64 else ArrayLength(count)
        for _ in range(count):  # vocabularies and merges: walk past, keep the length only
            if item_type == _STRING:
                (length,) = self._unpack("<Q")
                self._pos += length
            else:
                self._read_value(item_type)
        return ArrayLength(count)

    def _read_tensor_info(self) -> TensorInfo:
        name = self._read_string()
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        ggml_type, offset = self._unpack("<IQ")
        return TensorInfo(name, tuple(reversed(shape)), ggml_type, offset)


@dataclass(frozen=True)
class ArrayLength:
    """Stands for a metadata array that was skipped; ``count`` is its length."""

    count: int


def _dequantize(blocks: np.ndarray, ggml_type: int) -> torch.Tensor:
    """float32 values of ``blocks`` ([n_blocks, bytes_per_block] uint8), flattened."""
    if ggml_type not in _BLOCKS:
        from gguf.quants import dequantize

        values = np.ascontiguousarray(dequantize(blocks, ggml_type), dtype=np.float32)
        return torch.from_numpy(values).flatten()
    raw = torch.from_numpy(blocks)
    scale = raw[:, :2].contiguous().view(torch.float16).float()
    if ggml_type == 8:  # Q8_0: scale, 32 signed bytes
        return (raw[:, 2:].contiguous().view(torch.int8).float() * scale).flatten()
    packed = raw[:, 4:] if ggml_type == 3 else raw[:, 2:]
    # 16 bytes hold 32 values: the low nibbles are values 0..15, the high nibbles 16..31
    nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()
    if ggml_type == 3:  # Q4_1: scale, minimum, nibbles
        return (nibbles * scale + raw[:, 2:4].contiguous().view(torch.float16).float()).flatten()
    return ((nibbles - 8.0) * scale).flatten()  # Q4_0: scale, nibbles offset by 8


def hf_config_kwargs(gguf: GGUFFile) -> tuple[str, dict]:
    """(transformers model_type, keyword arguments for ``AutoConfig.for_model``) describing the
    file's model; ValueError naming an architecture this loader does not read."""
    arch = gguf.architecture
    gguf_families.check_architecture(arch)
    if "rope_freqs.weight" in gguf.tensors:
        raise ValueError(
            f"{gguf.path} scales its rotary frequencies with a rope_freqs tensor (Llama 3.1 style), "
            "which the GGUF path does not support; use the model's Hugging Face directory"
        )
    meta = gguf.metadata

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    vocab = key("vocab_size") or _count(meta.get("tokenizer.ggml.tokens"))
    kwargs = dict(
        architectures=[gguf_families.ARCHITECTURES[arch][1]],
        num_hidden_layers=key("block_count"),
        max_position_embeddings=key("context_length"),
        hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"),
        num_attention_heads=key("attention.head_count"),
        num_key_value_heads=key("attention.head_count_kv", key("attention.head_count")),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=key("rope.freq_base", 10000.0),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if key("attention.key_length"):
        kwargs["head_dim"] = key("attention.key_length")
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none" and not (scaling == "yarn" and arch in gguf_families.YARN):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; supported: ['linear']")
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    return gguf_families.family_kwargs(gguf, kwargs)


def _count(value) -> int | None:
    return value.count if isinstance(value, ArrayLength) else None


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of an ``arch`` model; None for tensors the model
    does not use (Phi-3's rope factors are read into the config)."""
    bare = re.fullmatch(r"blk\.(\d+)\.(\w+(?:\.bias)?)", gguf_name)
    if bare and bare.group(2) in gguf_families.BARE_LAYER_NAMES.get(arch, {}):
        return f"model.layers.{bare.group(1)}.{gguf_families.BARE_LAYER_NAMES[arch][bare.group(2)]}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = gguf_families.layer_names(arch)
        if part not in names:
            return None
        bare = names[part] in gguf_families.BARE and kind == "weight"
        return f"model.layers.{layer}.{names[part]}" + ("" if bare else f".{kind}")
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None


def hf_tensors(gguf: GGUFFile, keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Every tensor the model uses, under its Hugging Face name, in Hugging Face layout; with
    ``keep_blocks``, 2-D tensors of ``BLOCK_TYPES`` as stored (``GGUFFile.blocks``)."""
    meta, arch = gguf.metadata, gguf.architecture
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    pending: dict = {}  # halves of a tensor the checkpoint holds whole (gguf_families.regroup)
    layers = gguf_families.qwen35_layers(meta) if arch == "qwen35" else None
    for gguf_name in gguf.tensors:
        name = hf_tensor_name(gguf_name, arch)
        if name is None or (layers is not None and _layer_of(name) >= layers):
            continue
        info = gguf.tensors[gguf_name]
        # qwen35's linear-attention tensors are reordered, some by column: as floats
        reordered = arch == "qwen35" and ".linear_attn." in name
        as_stored = keep_blocks and len(info.shape) == 2 and info.ggml_type in BLOCK_TYPES and not reordered
        tensor = gguf.blocks(gguf_name) if as_stored else gguf.tensor(gguf_name)
        if shift := gguf_families.norm_shift(arch, name):  # (a float tensor: norms are never blocks)
            tensor = tensor.float() + shift
        if reordered:
            tensor = gguf_families.qwen35_tensor(name, tensor, meta)
        if arch in gguf_families.INTERLEAVED_ROTARY and name.endswith(("q_proj.weight", "k_proj.weight")):
            count = heads if "q_proj" in name else kv_heads
            if as_stored:  # whole rows move: a copy of these two tensors' blocks in the new order
                order = _unpermute_rotary_rows(torch.arange(info.shape[0]), count)
                stored, tensor = tensor, GGUFTensor(tensor.data[order], tensor.ggml_type, tensor.shape)
                release_pages(stored.data)  # read once for the copy, never again
            else:
                tensor = _unpermute_rotary_rows(tensor, count)
        yield from gguf_families.regroup(arch, name, tensor, pending)
    if pending:
        raise ValueError(f"{gguf.path}: {sorted(pending)} lack their other half (gate or up)")


def _layer_of(hf_name: str) -> int:
    """The decoder layer of a ``model.layers.N.`` name; -1 for the others (embedding, head)."""
    match = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return int(match.group(1)) if match else -1


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: rows (pair, 2) back to rotate-half (2, pair)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape
    )
