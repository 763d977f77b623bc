"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in) dequantized at load.

A checkpoint stores a weight [..., rows, cols] as ``<name>_blocks`` uint8 [..., rows, cols / 32, 16]
(two 4-bit E2M1 values a byte, the low nibble first) and ``<name>_scales`` uint8
[..., rows, cols / 32] (one power-of-two exponent per 32 values, biased by 127). Every value is
exact in bfloat16, so the weight is rebuilt there; gpt-oss's fused experts then take it transposed
([E, cols, rows]: transformers' layout of the bf16 checkpoints).
"""

from __future__ import annotations

import torch

# the 16 E2M1 codes: sign bit, then two exponent bits and one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK_VALUES = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bfloat16 [..., rows, cols] from ``blocks`` [..., rows, groups, 16] and ``scales``
    [..., rows, groups]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype} (uint8 [..., groups, 16] and [..., groups])")
    if blocks.dim() > 3:  # one leading slice (an expert) at a time: the temporaries stay small
        return torch.stack([dequantize_mxfp4(b, s) for b, s in zip(blocks, scales, strict=True)])
    table = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16)
    values = torch.stack((table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]), dim=-1)  # low first
    values = values.flatten(-2)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(torch.bfloat16).flatten(-2)


def dequantize_checkpoint(weights, transpose: bool = True):
    """The (name, tensor) pairs of a checkpoint with each ``<name>_blocks`` / ``<name>_scales``
    pair replaced by ``<name>``, dequantized (transposed to [..., cols, rows] with ``transpose``);
    whichever of a pair comes first waits for the other, every other tensor passes through."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales"):
            yield name, tensor
            continue
        if base not in waiting:
            waiting[base] = (part, tensor)
            continue
        other_part, other = waiting.pop(base)
        blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
        weight = dequantize_mxfp4(blocks, scales)
        yield base, weight.transpose(-1, -2) if transpose else weight
    if waiting:
        raise ValueError(f"MXFP4 checkpoint tensors without their pair: {sorted(waiting)[:4]}")
