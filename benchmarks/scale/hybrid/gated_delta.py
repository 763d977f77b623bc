"""The Gated DeltaNet layer's token mixing on the CPU, C kernels (csrc/gated_delta.c) against the
torch forms, in one run (``python -m kvserve.benchmarks.scale.hybrid.gated_delta``): one linear-attention
layer of a ``testing.random_model`` shape (qwen3.5-0.8b and qwen3.5-2b share it: 16 key and value
heads of 128, conv kernel 4), both paths through the layer's own code (``GatedDeltaNet._decode`` and
``_sequence``; the torch path is the same layer with its kernels switched off), after its input
projection and before its gated norm:

- decode: ``--batch`` sequences, one token each, on scattered rows of a state cache of
  ``--slots`` rows (torch: gathered, stepped, written back; C: in place), ms per step;
- prefill: one fresh prompt of each ``--prompt`` length (torch: the chunked WY form; C: the
  recurrent form in strips), tokens per second;
- the gated norm after the rule (``GatedDeltaNet._normed``) on each ``--prompt`` length's rule
  output (torch: ``_gated_norm``'s dozen passes; C: ``gdn_gated_norm``), tokens per second.

The two paths alternate, ``--repeats`` times each; each figure is the fastest of its repeats, and
the ratio torch / C is printed beside the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import functools

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.ceiling import best_time
from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.models.qwen3_5 import GatedDeltaNet, state_shapes
from kvserve.kernels.cpu.gated_delta import gated_delta_kernels
from kvserve.testing.random_model import make_config

CPU = torch.device("cpu")


def make_layer(shape: str, dtype: torch.dtype, slots: int) -> GatedDeltaNet:
    config = make_config(shape)
    layer = GatedDeltaNet(config, ParallelContext()).to(dtype)
    gen = torch.Generator().manual_seed(0)
    layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.3)
    conv_shape, state_shape = state_shapes(config)
    layer.bind_state(torch.randn(slots, *conv_shape, generator=gen).to(dtype),
                     torch.randn(slots, *state_shape, generator=gen) * 0.05)
    return layer


def inputs(layer: GatedDeltaNet, tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, layer.conv_size, generator=gen).to(dtype)
    g = -torch.rand(tokens, layer.num_v_heads, generator=gen)
    return mixed, g, torch.rand(tokens, layer.num_v_heads, generator=gen).to(dtype)


def switcher(layer: GatedDeltaNet):
    """A function turning the layer's C kernels on (True) or off (False: its torch forms)."""
    kernels = layer._kernels

    def switch(on: bool) -> None:
        layer._kernels = kernels if on else (lambda mixed: None)
    return switch


def race(fn, switch, repeats: int) -> tuple[float, float]:
    """(torch s, C s): the fastest of ``repeats`` each, the two alternating."""
    best = {False: float("inf"), True: float("inf")}
    for i in range(repeats):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            switch(on)
            best[on] = min(best[on], best_time(fn, CPU, 1))
    switch(True)
    return best[False], best[True]


def difference(layer: GatedDeltaNet, fn, switch) -> float:
    """The largest difference between the two paths' outputs from the same state."""
    saved = layer.conv_states.clone(), layer.recurrent_states.clone()
    outs = []
    for on in (False, True):
        layer.conv_states.copy_(saved[0])
        layer.recurrent_states.copy_(saved[1])
        switch(on)
        outs.append(fn())
    switch(True)
    return (outs[0] - outs[1]).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.hybrid.gated_delta",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-2b", choices=("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-tiny"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="decode: sequences per step")
    ap.add_argument("--slots", type=int, default=32, help="rows of the state cache")
    ap.add_argument("--prompt", type=int, nargs="+", default=[512, 2048, 8192], help="prefill lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    kernels = gated_delta_kernels()
    if kernels is None:
        raise SystemExit("no CPU kernels here (no compiler, a failed build, or KVSERVE_CPU_KERNELS=0)")
    dtype = getattr(torch, args.dtype)
    if max(args.batch) > args.slots:
        raise SystemExit(f"--slots ({args.slots}) must hold the largest --batch ({max(args.batch)})")
    layer = make_layer(args.shape, dtype, args.slots)
    switch = switcher(layer)
    if layer._kernels(torch.empty(1, layer.conv_size, dtype=dtype)) is None:
        raise SystemExit(f"the kernels do not take the {args.shape} layer's shape")
    print(f"{args.shape} linear layer ({layer.num_k_heads} key / {layer.num_v_heads} value heads of "
          f"{layer.k_dim}/{layer.v_dim}), {args.dtype}, {torch.get_num_threads()} threads, "
          f"C path: {kernels.vector_bits or 'portable'}-bit vectors")
    figures: dict = {"shape": args.shape, "dtype": args.dtype, "decode": [], "prefill": []}
    with torch.no_grad():
        for batch in args.batch:
            slots = list(range(args.slots - 1, -1, -max(1, args.slots // batch)))[:batch]  # scattered rows
            mixed, g, beta = inputs(layer, batch, dtype, batch)
            step = functools.partial(layer._decode, mixed, g, beta, slots)
            diff = difference(layer, step, switch)
            t, c = race(step, switch, args.repeats)
            figures["decode"].append({"batch": batch, "torch_ms": t * 1e3, "c_ms": c * 1e3, "ratio": t / c})
            print(f"decode  batch {batch:>5}: torch {t * 1e3:8.3f} ms  C {c * 1e3:8.3f} ms  "
                  f"torch/C {t / c:5.2f}x  (max diff {diff:.1e})", flush=True)
        for tokens in args.prompt:
            mixed, g, beta = inputs(layer, tokens, dtype, tokens)
            prompt = functools.partial(layer._sequence, mixed, g, beta, 0, True)
            diff = difference(layer, prompt, switch)
            t, c = race(prompt, switch, args.repeats)
            figures["prefill"].append({"tokens": tokens, "torch_tok_s": tokens / t, "c_tok_s": tokens / c,
                                       "ratio": t / c})
            print(f"prefill {tokens:>5} tokens: torch {tokens / t:9.0f} tok/s  C {tokens / c:9.0f} tok/s  "
                  f"C/torch {t / c:5.2f}x  (max diff {diff:.1e})", flush=True)
        figures["gated_norm"] = []
        for tokens in args.prompt:
            gen = torch.Generator().manual_seed(tokens)
            rule = torch.randn(tokens, layer.num_v_heads, layer.v_dim, generator=gen)
            z = torch.randn(tokens, layer.num_v_heads * layer.v_dim, generator=gen).to(dtype)
            mixed = torch.empty(tokens, layer.conv_size, dtype=dtype)  # _normed reads only its shape, dtype
            norm = functools.partial(layer._normed, rule, z, mixed)
            diff = difference(layer, norm, switch)
            t, c = race(norm, switch, args.repeats)
            figures["gated_norm"].append({"tokens": tokens, "torch_tok_s": tokens / t, "c_tok_s": tokens / c,
                                          "ratio": t / c})
            print(f"norm    {tokens:>5} tokens: torch {tokens / t:9.0f} tok/s  C {tokens / c:9.0f} tok/s  "
                  f"C/torch {t / c:5.2f}x  (max diff {diff:.1e})", flush=True)
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
