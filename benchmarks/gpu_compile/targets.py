"""The compile targets and the H200 the roofline times are for.

Per-SM limits from NVIDIA's CUDA C programming guide (compute capabilities table): registers per
SM 64K 32-bit everywhere here; shared memory a block may opt in to 163 KiB on sm_80, 99 KiB on
sm_89, 227 KiB on sm_90; resident warps per SM 64 on sm_80 and sm_90, 48 on sm_89.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    max_smem_per_block: int  # bytes, with the opt-in a launcher gets from Triton
    smem_per_sm: int  # bytes
    max_warps_per_sm: int
    regs_per_sm: int = 65536
    max_ctas_per_sm: int = 32

    def ctas_per_sm(self, regs: int, smem: int, num_warps: int) -> int:
        """Resident CTAs per SM by registers (allocated per warp in units of 256), shared memory
        (plus the 1 KiB the driver reserves per CTA) and warps."""
        regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
        by_regs = self.regs_per_sm // (regs_per_warp * num_warps)
        by_smem = self.smem_per_sm // (smem + 1024) if smem else self.max_ctas_per_sm
        by_warps = self.max_warps_per_sm // num_warps
        return max(0, min(by_regs, by_smem, by_warps, self.max_ctas_per_sm))


TARGETS = {
    "sm_80": Target("sm_80", 80, 163 * 1024, 164 * 1024, 64),
    "sm_89": Target("sm_89", 89, 99 * 1024, 100 * 1024, 48),
    "sm_90": Target("sm_90", 90, 227 * 1024, 228 * 1024, 64),
}

# H200 SXM: HBM3e at 4.8 TB/s; dense bf16/fp16 tensor-core rate 989 TFLOP/s (NVIDIA's data sheet)
H200_BYTES_PER_S = 4.8e12
H200_FLOPS_PER_S = 989e12


def roofline_us(bytes_moved: float, flops: float) -> float:
    """The kernel's time on an H200 if it ran at whichever roof binds, in microseconds."""
    return max(bytes_moved / H200_BYTES_PER_S, flops / H200_FLOPS_PER_S) * 1e6
