"""Compile one case of the table for one target and read its resources from the cubin.

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))``
runs Triton's whole pipeline down to ``ptxas`` without a GPU; ``cuobjdump --dump-resource-usage``
(both ship in the triton wheel, ``triton/backends/nvidia/bin``) then reads registers, stack and
local memory per kernel. A stack frame or local memory means the kernel spills. Shared memory is
Triton's own figure (``metadata.shared``: what the launch asks for) plus the cubin's static part.

The signature is the one the launcher's arguments give Triton's JIT: pointers of the case's
element types, 16-byte aligned (torch allocations), integers 16-divisible where the engine's are
(strides of 64-wide heads), ``do_not_specialize`` integers left plain.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.benchmarks.gpu_compile.shapes import Case
from kvserve.benchmarks.gpu_compile.targets import Target, roofline_us

# integer arguments that hold multiples of 16 in every engine launch (strides of [.., heads, head_dim]
# tensors and cache blocks with head_dim >= 16 a multiple of 16; the experts' weight strides)
DIVISIBLE = {"q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h", "c_stride_block", "c_stride_slot",
             "c_stride_head", "k_stride_t", "v_stride_t", "cache_stride_block", "cache_stride_slot",
             "N", "K", "a_stride_m", "w_stride_e", "w_stride_n", "c_stride_m"}  # fmt: skip
FLOATS = {"scale", "soft_cap"}


@dataclass(frozen=True)
class Result:
    case: Case
    target: Target
    regs: int = 0
    stack: int = 0  # bytes of stack frame per thread
    local: int = 0  # bytes of local memory per thread
    smem: int = 0  # bytes of shared memory per CTA
    error: str = ""

    @property
    def spills(self) -> int:
        return self.stack + self.local

    @property
    def warps_per_sm(self) -> int:
        warps = self.case.launch.num_warps
        return warps * self.target.ctas_per_sm(self.regs, self.smem, warps)

    @property
    def roofline_us(self) -> float:
        return roofline_us(self.case.bytes_moved, self.case.flops)

    def problems(self) -> list[str]:
        if self.error:
            return [f"compile error: {self.error}"]
        found = []
        if self.spills:
            found.append(f"spills ({self.stack} B stack, {self.local} B local)")
        if self.smem > self.target.max_smem_per_block:
            found.append(f"shared memory {self.smem} B > {self.target.max_smem_per_block} B")
        return found


def nvidia_bin() -> Path:
    """triton/backends/nvidia/bin of the installed wheel; raise naming what is missing."""
    import triton.backends.nvidia as nvidia

    folder = Path(nvidia.__file__).parent / "bin"
    missing = [tool for tool in ("ptxas", "cuobjdump") if not os.access(folder / tool, os.X_OK)]
    if missing:
        raise RuntimeError(f"{folder} lacks {', '.join(missing)}: this triton wheel cannot compile for CUDA")
    return folder


def kernel_fn(name: str):
    from kvserve.kernels.triton import fused_moe, kv_store, paged_attention

    for module in (paged_attention, kv_store, fused_moe):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(f"no Triton kernel named {name}")


def signature(fn, case: Case) -> tuple[dict[str, str], dict[tuple[int], object], dict[tuple[int], list]]:
    """(signature, constexprs, attrs) for ``ASTSource`` from the kernel's parameters."""
    constexprs = case.launch.constexprs
    names = fn.arg_names
    unknown = set(constexprs) - set(names)
    if unknown:
        raise ValueError(f"{fn.__name__} has no parameters {sorted(unknown)}")
    plain = set(getattr(fn, "do_not_specialize", ()) or ())
    plain |= {names[i] for i in plain if isinstance(i, int)}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
        elif name.endswith("_ptr"):
            sig[name] = "*" + case.pointers.get(name, case.dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in DIVISIBLE and name not in plain:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_case(case: Case, target: Target) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        if case.recorded >= 0:  # one of fla-core's launches, as its host code made it
            from kvserve.benchmarks.gpu_compile.fla_kernels import recorded_source

            fn, sig, consts, attrs, options = recorded_source(case, target)
        else:
            fn = kernel_fn(case.kernel)
            sig, consts, attrs = signature(fn, case)
            options = case.launch.options()
        compiled = triton.compile(ASTSource(fn, sig, consts, attrs),
                                  target=GPUTarget("cuda", target.capability, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler failure is a row of the report
        return Result(case, target, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    usage = resource_usage(compiled.asm["cubin"], case.kernel)
    return Result(case, target, regs=usage["REG"], stack=usage["STACK"], local=usage["LOCAL"],
                  smem=int(compiled.metadata.shared) + usage["SHARED"])  # fmt: skip


def resource_usage(cubin: bytes, kernel: str) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of ``kernel`` as ``cuobjdump --dump-resource-usage`` prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(nvidia_bin() / "cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    block = text.split(f"Function {kernel}:", 1)
    if len(block) != 2:
        raise RuntimeError(f"cuobjdump printed no resource usage for {kernel}:\n{text}")
    line = block[1].strip().splitlines()[0]
    found = dict(re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", line))
    return {key: int(found.get(key, 0)) for key in ("REG", "STACK", "SHARED", "LOCAL")}
