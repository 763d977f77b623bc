"""gpt-oss (``GptOssForCausalLM``): a mixture-of-experts decoder whose attention layers alternate a
128-token window with full attention, each with learned attention sinks.

As transformers 5.24's ``models/gpt_oss`` computes it:
- attention: q, k, v and o with biases; one sink logit per head in each softmax's denominator
  (``self_attn.sinks``, owned by the layer's ``Attention``); YaRN rotary;
- router: a linear layer with a bias; the top-k logits are chosen first and softmaxed among
  themselves (not all experts' probabilities renormalised);
- experts: biased projections in the checkpoint's layout, ``gate_up_proj`` [E, H, 2I] with gate and
  up columns interleaved, ``down_proj`` [E, I, H]; the activation is SwiGLU clamped by
  ``swiglu_limit``: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``.

Checkpoints with MXFP4 experts (``quantization_config.quant_method`` mxfp4, as OpenAI ships them:
``..._blocks`` and ``..._scales``) are dequantized at load (``layers/mxfp4.py``) into the serving
dtype; another quantization method is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext, divide
from kvserve.engine.layers.linear import LinearBase, copy_weight
from kvserve.engine.layers.moe import grouped_experts
from kvserve.engine.layers.mxfp4 import dequantize_checkpoint
from kvserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.engine.models.registry import register_model
from kvserve.engine.models.variants import layer_window


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases (``attention_bias``), the layer's window and sinks."""

    def __init__(self, config, backend, parallel: ParallelContext, layer_idx: int):
        window = layer_window(config, layer_idx)
        super().__init__(config, backend, parallel, sinks=True,
                         **({"sliding_window": window} if window is not None else {}))


class ClampedSwiGLU(nn.Module):
    """gpt-oss's activation over interleaved gate, up columns of the gate|up product."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = x[..., ::2].clamp(max=self.limit)
        up = x[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExperts(nn.Module):
    """Every expert's biased gate|up and down projections, in the checkpoint's layout; this rank's
    slice of the intermediate dimension (whole interleaved gate, up pairs). The down bias is added
    by rank 0 only: the ranks' outputs are partial sums."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        local = divide(intermediate_size, parallel.size, "moe intermediate size")
        empty = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)  # noqa: E731
        self.gate_up_proj = empty(num_experts, hidden_size, 2 * local)
        self.gate_up_proj_bias = empty(num_experts, 2 * local)
        self.down_proj = empty(num_experts, local, hidden_size)
        self.down_proj_bias = empty(num_experts, hidden_size)
        for param in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank = self.parallel.rank
        if param is self.down_proj_bias:
            copy_weight(param.data, loaded)
        elif param is self.down_proj:  # rows: the intermediate dimension
            copy_weight(param.data, loaded.narrow(1, rank * param.shape[1], param.shape[1]))
        else:  # the last dimension holds the interleaved gate, up columns
            width = param.shape[-1]
            copy_weight(param.data, loaded.narrow(-1, rank * width, width))


class GptOssMoe(nn.Module):
    def __init__(self, config, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.router = LinearBase(config.hidden_size, config.num_local_experts, bias=True, parallel=parallel)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     parallel)
        self.act = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        experts = self.experts
        out = grouped_experts(
            x, experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2), weights, ids,
            act=self.act, b13=experts.gate_up_proj_bias,
            b2=experts.down_proj_bias if self.parallel.rank == 0 else None,
        )
        return self.parallel.all_reduce(out)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config, backend, parallel, layer_idx):
        return GptOssAttention(config, backend, parallel, layer_idx)

    def make_mlp(self, config, parallel: ParallelContext, layer_idx: int) -> nn.Module:
        return GptOssMoe(config, parallel)


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


@register_model
class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    supports_sliding_window = True
    checkpoint_renames = {".self_attn.sinks": ".self_attn.attn.sinks"}  # checkpoint name -> ours
    attention_needs = frozenset({"sinks"})  # the auto backend on a GPU: Triton (flash-attn 2 has no sinks)

    def transform_checkpoint(self, weights):
        """MXFP4 experts' blocks and scales as the dequantized weights they stand for."""
        return dequantize_checkpoint(weights) if quantization_method(self.config) == "mxfp4" else weights

    @staticmethod
    def refuse_unsupported(hf_config) -> None:
        method = quantization_method(hf_config)
        if method not in (None, "mxfp4"):
            raise ValueError(f"GptOssForCausalLM with {method} weights (quantization_config) is not "
                             "supported; supported: bf16/float32 and mxfp4 experts")


def quantization_method(config) -> str | None:
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    return (quantization.get("quant_method") if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", None))
