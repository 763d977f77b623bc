"""fla-core's gated delta rule kernels in the compile table (the GPU path of the hybrids' linear
layers, engine/layers/gated_delta_gpu.py): the chunked form's kernels do not run under Triton's
interpreter, so this is where they are checked without a GPU (the fused recurrent one is also
tested against the torch form there).

Their launches are fla-core's own, found by running its host code, not written here: with a
compile-only driver active (its target the table's target; no device) and Triton's
``jit_cache_hook`` set, every ``kernel[grid](...)`` the host code makes stops before compiling
and launching, and the hook records the kernel with its signature, constants, specialisation and
options, exactly what Triton would compile on that GPU. An autotuned kernel's benchmark calls each
of its configurations, so every configuration is recorded (and compiled), not only the one a
GPU's timing would pick; the autotuners' result caches are turned off while recording, so no
made-up timings reach a disk cache. Nothing is launched: outputs stay unwritten, which the host
code never reads back.

The calls are the layer's: ``chunk_gated_delta_rule`` over a 2,048-token prefill chunk and
``fused_recurrent_gated_delta_rule`` over a decode step of 64 sequences, both from a state, with
q and k L2-normalised in the kernel, in float32 (the layer hands float32 over), at the linear
layers' shapes of Qwen3.5-0.8B / 2B (16 key and 16 value heads of 128) and Qwen3-Next-80B-A3B
(16 key, 32 value heads of 128). fla-core chose its variants at import on a machine without a GPU
(no Hopper-only paths), so these are its portable kernels. No roofline time is given for them.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass

import torch

from kvserve.benchmarks.gpu_compile.shapes import Case
from kvserve.benchmarks.gpu_compile.targets import TARGETS, Target

# (label, key heads, value heads, key dim, value dim)
FLA_SHAPES = (("Qwen3.5-2B", 16, 16, 128, 128), ("Qwen3-Next-80B", 16, 32, 128, 128))
PREFILL_TOKENS = 2048
DECODE_BATCH = 64


@dataclass(frozen=True)
class RecordedLaunch:
    """What a row shows of a recorded launch (a ``Launch``'s fields)."""

    constexprs: tuple  # sorted (name, value) pairs of the kernel's compile-time constants
    num_warps: int
    num_stages: int

    def kwargs(self) -> dict:
        return {**dict(self.constexprs), "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class Recorded:
    kernel: str
    shape: str
    fn: object  # the JITFunction
    signature: dict
    constants: dict
    attrs: dict
    options: dict


class CompileOnlyDriver:
    """The driver Triton's JIT asks for its device, stream and target (and an autotuner for its
    benchmarker) while launches are recorded; there is no device behind it."""

    def __init__(self, target: Target):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", target.capability, 32)

    def get_current_device(self) -> str:
        return f"compile-only sm_{self.target.arch}"

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        def bench(call, quantiles=None, **_):
            call()  # records the configuration's launch
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench

    def get_empty_cache_for_benchmark(self) -> torch.Tensor:
        return torch.empty(1)

    def clear_cache(self, cache) -> None:
        pass

    def is_active(self) -> bool:
        return True


def fla_installed() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _autotuners():
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if name.startswith("fla."):
            for value in list(vars(module).values()):
                while hasattr(value, "fn"):
                    if isinstance(value, Autotuner):
                        yield value
                    value = value.fn


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _calls(label: str, hk: int, hv: int, dk: int, dv: int):
    """(shape label, call) of the layer's two calls at one model's shape, on CPU tensors."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def inputs(batch: int, tokens: int):
        return (torch.randn(batch, tokens, hk, dk), torch.randn(batch, tokens, hk, dk),
                torch.randn(batch, tokens, hv, dv), -torch.rand(batch, tokens, hv),
                torch.rand(batch, tokens, hv), torch.zeros(batch, hv, dk, dv))  # fmt: skip

    def prefill():
        q, k, v, g, beta, h0 = inputs(1, PREFILL_TOKENS)
        chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)

    def decode():
        q, k, v, g, beta, h0 = inputs(DECODE_BATCH, 1)
        fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)

    return ((f"{label} prefill T{PREFILL_TOKENS}", prefill), (f"{label} decode B{DECODE_BATCH}", decode))


@functools.cache
def record(target_name: str) -> tuple[Recorded, ...]:
    """Every distinct launch fla-core's host code makes for the layer's calls, on ``target_name``,
    in a stable order."""
    import fla.ops.gated_delta_rule  # noqa: F401 - imported (and its platform probed) before the driver
    from triton import knobs
    from triton.runtime import driver

    found: dict[tuple, Recorded] = {}
    current = {"shape": ""}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        options = {k: _tuples(v) for k, v in json.loads(compile["specialization_data"])["options"].items()}
        shape = current["shape"]
        found.setdefault((fn.name, shape, str(key)), Recorded(
            fn.name, shape, fn.jit_function, compile["signature"], compile["constants"],
            compile["configs"][0], options))  # fmt: skip
        return True  # compiled later, for each target; nothing is compiled or launched now

    tuners = list(_autotuners())
    for tuner in tuners:
        tuner.cache_results = False
        tuner.cache = {}
    previous_hook = knobs.runtime.jit_cache_hook
    previous_driver = driver._active  # None until first asked; reset_active() would make one (no GPU: fails)
    driver.set_active(CompileOnlyDriver(TARGETS[target_name]))
    knobs.runtime.jit_cache_hook = hook
    try:
        for model in FLA_SHAPES:
            for current["shape"], call in _calls(*model):
                for tuner in tuners:
                    tuner.cache = {}  # each shape and target tunes (records) anew
                call()
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver
    return tuple(found.values())


def fla_cases(target_name: str = "sm_90") -> list[Case]:
    """The table's rows of fla-core's kernels: one per recorded launch (``recorded`` indexes it)."""
    cases = []
    for i, r in enumerate(record(target_name)):
        names = r.fn.arg_names
        constexprs = tuple(sorted((names[k[0]] if isinstance(k, tuple) else str(k), v)
                                  for k, v in r.constants.items() if isinstance(v, bool | int)))
        launch = RecordedLaunch(constexprs, r.options["num_warps"], r.options["num_stages"])
        cases.append(Case(r.kernel, r.shape, "fp32", launch, 0.0, 0.0, recorded=i))
    return cases


def recorded_source(case: Case, target: Target):
    """(fn, signature, constants, attrs, options) of a recorded case, recorded for ``target``."""
    r = record(target.name)[case.recorded]
    if (r.kernel, r.shape) != (case.kernel, case.shape):
        raise RuntimeError(f"fla-core's launches on {target.name} differ from the table's: "
                           f"{r.kernel} ({r.shape}) where the table has {case.kernel} ({case.shape})")
    return r.fn, r.signature, r.constants, r.attrs, r.options
