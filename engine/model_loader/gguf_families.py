"""What each GGUF architecture kvserve loads means in Hugging Face terms: the config its metadata
describes, its tensor names, and how llama.cpp's converter (convert_hf_to_gguf.py) changed the
tensors on the way in.

- ``llama``: Llama, and Mistral (llama.cpp's converter writes MistralForCausalLM as ``llama``,
  with no window: llama.cpp runs it with full attention). A ``llama`` file that carries
  ``llama.attention.sliding_window`` loads as Mistral with that window on every layer; with a
  per-layer ``sliding_window_pattern`` too (Ministral's) it is refused. The q and
  k rows are interleaved per head for llama.cpp's rotary (undone in gguf_file.hf_tensors).
- ``qwen2``, ``qwen3``: as Hugging Face stores them.
- ``smollm3``: Llama's tensors (q and k interleaved as for ``llama``); every fourth layer without
  RoPE, as llama.cpp hard-codes it and transformers' config defaults it.
- ``phi3``: the fused ``attn_qkv`` and ``ffn_up`` (gate and up, as Phi-3 ships them); partial
  rotary from ``rope.dimension_count``; LongRoPE from the ``rope_factors_long`` / ``_short``
  tensors and ``rope.scaling.original_context_length``; ``attention.sliding_window`` (0: none).
- ``gemma2``, ``gemma3`` (text): the converter stores every RMSNorm weight as ``1 + w`` (Gemma's
  norm multiplies by ``1 + w``); the loader subtracts the 1 again. Layer norms are named
  ``attn_norm`` / ``post_attention_norm`` / ``ffn_norm`` / ``post_ffw_norm``. Gemma 2: attention
  and final logit soft caps, windows on alternate layers. Gemma 3: windows on five layers of six
  (``attention.sliding_window_pattern`` when a file lists them), ``rope.freq_base`` for the global
  layers and ``rope.freq_base_swa`` (else 10k) for the window layers; linear rope scaling applies to
  the global layers only. Neither family stores ``query_pre_attn_scalar``: llama.cpp takes the
  head dim, or hidden / heads for the 27B shapes (46 layers of Gemma 2, 62 of Gemma 3), and so
  does this loader unless the file has ``attention.scale``.

- ``gpt-oss``: the experts as 3-D tensors [E, out, in] (``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``, MXFP4 as llama.cpp's converter repacks OpenAI's blocks, or float), each with
  a bias; ``regroup`` interleaves gate and up back into the checkpoint's ``gate_up_proj`` [E, H, 2I]
  (and its bias) and transposes ``down_proj`` to [E, I, H]; MXFP4 is dequantized at load, as the
  safetensors path does. ``attn_sinks`` are the sinks, ``ffn_gate_inp`` the router, YaRN from
  ``rope.scaling.*`` (``truncate`` false, as gpt-oss ships it); windows on even layers.

- ``qwen35`` (Qwen3.5, the text model; llama.cpp writes ``Qwen3_5ForConditionalGeneration`` and
  ``Qwen3_5ForCausalLM`` alike): the ``ssm.*`` keys give the Gated DeltaNet shape, the layer kinds
  come from ``attention.recurrent_layers`` (else ``full_attention_interval``), the rotary share from
  ``rope.dimension_count`` (text positions make its interleaved MRoPE plain rotary). The converter
  stores A_log as -exp(A_log) (``ssm_a``), dt_bias as ``ssm_dt.bias``, the conv kernel squeezed to
  [channels, K], the zero-centred RMSNorm weights as 1 + w (not the gated ``ssm_norm``), and, when
  there are more value heads than key heads, the value heads in "tiled" order (the heads of one key
  head spread out) in the v rows of ``attn_qkv``, the conv's v channels, ``attn_gate``,
  ``ssm_alpha``/``ssm_beta``, ``ssm_a``, ``ssm_dt`` and the columns of ``ssm_out``; ``qwen35_tensor``
  undoes each. The multi-token-prediction layers after ``block_count - nextn_predict_layers`` are
  skipped.

Refused by name: ``clip`` (a vision or audio projector, an mmproj file, as llama.cpp writes
Gemma 3's vision tower), and every architecture not listed above.
"""

from __future__ import annotations

import numpy as np
import torch

# GGUF architecture -> (transformers model_type, architecture class name)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
}
MISTRAL = ("mistral", "MistralForCausalLM")
YARN = ("gpt-oss",)  # rope.scaling.type yarn read (others: linear only)
REFUSED = {
    "clip": "it is a vision or audio projector (an mmproj file); kvserve serves text models only",
}
INTERLEAVED_ROTARY = ("llama", "smollm3")  # q and k rows interleaved per head by the converter
GEMMA = ("gemma2", "gemma3")
LLAMA_CPP_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # where llama.cpp scales by hidden / heads

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
LAYER_NAMES_OF = {
    "phi3": {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    **dict.fromkeys(GEMMA, {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm"}),
    "gpt-oss": {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                "ffn_down_exps": "mlp.experts.down_proj"},
    "qwen35": {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
               "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
               "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
               "ssm_out": "linear_attn.out_proj"},
}
# tensors whose checkpoint name is not the layer name + .weight / .bias
BARE_LAYER_NAMES = {"qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}}
QWEN35_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                       "k_norm.weight", "model.norm.weight")
BARE = ("self_attn.sinks",)  # checkpoint names without .weight


def check_architecture(arch: str) -> None:
    """ValueError naming ``arch`` when this loader does not read it."""
    if arch in REFUSED:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: {REFUSED[arch]}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")


def layer_names(arch: str) -> dict[str, str]:
    return LAYER_NAMES_OF.get(arch, LAYER_NAMES)


def norm_shift(arch: str, hf_name: str) -> float:
    """What to add to a stored tensor: -1 for Gemma's and Qwen3.5's zero-centred RMSNorm weights
    (stored as 1 + w)."""
    if arch in GEMMA and hf_name.endswith("norm.weight"):
        return -1.0
    return -1.0 if arch == "qwen35" and hf_name.endswith(QWEN35_ZERO_CENTRED) else 0.0


def family_kwargs(gguf, kwargs: dict) -> tuple[str, dict]:
    """(transformers model_type, config kwargs): ``kwargs`` (the keys every family shares) with
    the family's own; ``gguf`` a gguf_file.GGUFFile."""
    arch, meta = gguf.architecture, gguf.metadata

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    model_type, architecture = ARCHITECTURES[arch]
    window = key("attention.sliding_window") or None
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if arch == "llama" and window and key("attention.sliding_window_pattern") is not None:
        raise ValueError("GGUF architecture 'llama' with attention.sliding_window_pattern (windows on some "
                         "layers, as Ministral) is not supported; load the Hugging Face checkpoint")
    if arch == "llama" and window:
        model_type, architecture = MISTRAL
        kwargs["sliding_window"] = window
    elif arch == "phi3":
        kwargs["sliding_window"] = window
        rope_dims = key("rope.dimension_count", head_dim)
        if rope_dims != head_dim:
            kwargs["partial_rotary_factor"] = rope_dims / head_dim
        if "rope_factors_long.weight" in gguf.tensors:
            kwargs["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
            kwargs["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": _shortest(gguf.tensor("rope_factors_long.weight")),
                "short_factor": _shortest(gguf.tensor("rope_factors_short.weight")),
            }
    elif arch in GEMMA:
        scale = key("attention.scale")
        wide = kwargs["num_hidden_layers"] == LLAMA_CPP_27B_LAYERS[arch]
        kwargs["query_pre_attn_scalar"] = (1.0 / scale**2 if scale else
                                           kwargs["hidden_size"] // kwargs["num_attention_heads"] if wide
                                           else head_dim)
        kwargs["head_dim"] = head_dim
        kwargs["sliding_window"] = window
        kwargs["layer_types"] = _gemma_layer_types(arch, key("attention.sliding_window_pattern"), window,
                                                   kwargs["num_hidden_layers"])
        kwargs["final_logit_softcapping"] = key("final_logit_softcapping")
        if arch == "gemma2":
            kwargs["attn_logit_softcapping"] = key("attn_logit_softcapping")
        else:
            full = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
            if "rope_scaling" in kwargs:  # linear: the global layers only, as llama.cpp applies it
                full = {**full, **kwargs.pop("rope_scaling")}
            local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10000.0)}
            kwargs["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    elif arch == "qwen35":
        _qwen35_kwargs(key, kwargs, head_dim)
    elif arch == "gpt-oss":
        kwargs["sliding_window"] = window
        kwargs["num_local_experts"] = key("expert_count")
        kwargs["num_experts_per_tok"] = key("expert_used_count")
        kwargs["intermediate_size"] = key("expert_feed_forward_length", kwargs["intermediate_size"])
        if key("rope.scaling.type") == "yarn":
            kwargs["rope_parameters"] = {
                "rope_type": "yarn", "rope_theta": kwargs.pop("rope_theta"),
                "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0), "truncate": False,
            }
    kwargs["architectures"] = [architecture]
    return model_type, kwargs


def regroup(arch: str, name: str, tensor, pending: dict) -> list[tuple[str, object]]:
    """The checkpoint tensors ``name`` completes: itself, or (gpt-oss experts) nothing until gate
    and up are both read (kept in ``pending``), then the interleaved ``gate_up_proj``."""
    if arch != "gpt-oss" or ".mlp.experts." not in name:
        return [(name, tensor)]
    base, part, kind = name.rsplit(".", 2)  # ...mlp.experts, gate_proj|up_proj|down_proj, weight|bias
    suffix = "" if kind == "weight" else "_bias"
    if part == "down_proj":  # [E, H, I] -> [E, I, H]
        down = tensor if kind == "bias" else tensor.transpose(1, 2).contiguous()
        return [(f"{base}.down_proj{suffix}", down)]
    pending[(base, part, kind)] = tensor
    gate, up = pending.get((base, "gate_proj", kind)), pending.get((base, "up_proj", kind))
    if gate is None or up is None:
        return []
    del pending[(base, "gate_proj", kind)], pending[(base, "up_proj", kind)]
    both = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows gate0, up0, gate1, ...: [E, 2I(, H)]
    return [(f"{base}.gate_up_proj{suffix}", both if kind == "bias" else both.transpose(1, 2).contiguous())]


def _shortest(values) -> list[float]:
    """float32 values as the shortest decimals that round to them (1.1, not 1.100000023841858: what
    the checkpoint's config.json held before the converter stored it in float32)."""
    return [float(np.format_float_positional(np.float32(v), unique=True)) for v in values.float().tolist()]


def _gemma_layer_types(arch: str, pattern, window, layers: int) -> list[str]:
    """Which layers have the window: a listed pattern (one flag per layer, true: window), else
    llama.cpp's default for the family (Gemma 2: even layers; Gemma 3: five of every six)."""
    if not window:
        return ["full_attention"] * layers
    if isinstance(pattern, list) and len(pattern) == layers:
        flags = [bool(p) for p in pattern]
    else:
        period = pattern if isinstance(pattern, int) and pattern > 0 else (2 if arch == "gemma2" else 6)
        flags = [(i + 1) % period != 0 for i in range(layers)]
    return ["sliding_attention" if f else "full_attention" for f in flags]



def _qwen35_kwargs(key, kwargs: dict, head_dim: int) -> None:
    layers = kwargs["num_hidden_layers"] = kwargs["num_hidden_layers"] - key("nextn_predict_layers", 0)
    value_heads = key("ssm.time_step_rank")
    kwargs.update(linear_conv_kernel_dim=key("ssm.conv_kernel"), linear_key_head_dim=key("ssm.state_size"),
                  linear_num_key_heads=key("ssm.group_count"), linear_num_value_heads=value_heads,
                  linear_value_head_dim=key("ssm.inner_size") // value_heads, head_dim=head_dim)
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, list):
        kinds = [bool(r) for r in recurrent[:layers]]
    else:
        interval = key("full_attention_interval", 4)
        kinds = [(i + 1) % interval != 0 for i in range(layers)]
    kwargs["layer_types"] = ["linear_attention" if r else "full_attention" for r in kinds]
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta"),
                                 "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim}


def qwen35_layers(meta: dict) -> int:
    """The decoder layers of a ``qwen35`` file (the MTP layers after them are not loaded)."""
    return meta["qwen35.block_count"] - meta.get("qwen35.nextn_predict_layers", 0)


def qwen35_tensor(name: str, tensor: torch.Tensor, meta: dict) -> torch.Tensor:
    """The checkpoint's tensor from what llama.cpp's converter stored under ``name`` (HF name)."""
    if name.endswith("linear_attn.A_log"):
        tensor = torch.log(-tensor.float())
    elif name.endswith("linear_attn.conv1d.weight"):
        tensor = tensor.unsqueeze(1)
    key_heads, value_heads = meta["qwen35.ssm.group_count"], meta["qwen35.ssm.time_step_rank"]
    if key_heads == value_heads or ".linear_attn." not in name:
        return tensor
    value_dim = meta["qwen35.ssm.inner_size"] // value_heads
    per_key = value_heads // key_heads

    def grouped(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """Tiled value heads [per_key, key_heads] back to grouped [key_heads, per_key] along ``dim``."""
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1:])
        return t.transpose(dim, dim + 1).reshape(shape)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk = 2 * meta["qwen35.ssm.state_size"] * key_heads
        return torch.cat((tensor[:qk], grouped(tensor[qk:], 0, value_dim)))
    if name.endswith("in_proj_z.weight"):
        return grouped(tensor, 0, value_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return grouped(tensor, 0, 1)
    if name.endswith("out_proj.weight"):
        return grouped(tensor, 1, value_dim)
    return tensor
