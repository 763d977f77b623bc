"""Triton compiles a kernel once per *specialization*: argument dtypes, constexprs, and for
integers whether they equal 1 or divide by 16 (pointers: whether 16-byte aligned). An integer
that changes from step to step, like the block table's row stride, would make Triton compile new
variants while serving. This pins down that after a warm-up (one prefill, one split and one
unsplit decode) a varied run adds no variant.

Keys are computed with Triton's own binder for an NVIDIA target (sm90), from the arguments of
every launch (a pre-run hook), so the count is the one a GPU would see; under the interpreter
nothing is compiled, on a GPU the same hook sees the real launches.
"""

import os
import random
from contextlib import contextmanager

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

from kvserve.engine.layers.attention.backend import create_attention_backend  # noqa: E402
from kvserve.engine.model_input import ModelInput  # noqa: E402
from kvserve.kernels.triton import kv_store, paged_attention  # noqa: E402

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16
KERNELS = {
    "store": kv_store._store_kv_kernel,
    "prefill": paged_attention._paged_prefill_kernel,
    "decode": paged_attention._paged_decode_kernel,
    "reduce": paged_attention._reduce_splits_kernel,
}


@contextmanager
def recorded_keys():
    """Yields {kernel name: set of cache keys} filled by every launch inside the block, and
    {kernel name: list of launch arguments by name}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = make_backend(GPUTarget("cuda", 90, 32))
    keys = {name: set() for name in KERNELS}
    launches = {name: [] for name in KERNELS}
    hooks = []
    for name, kernel in KERNELS.items():
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        binder = create_function_from_signature(jit.signature, jit.params, target)

        def hook(*args, _name=name, _binder=binder, _names=jit.arg_names, **kwargs):
            keys[_name].add(str(_binder(*args, **kwargs)[1]))
            launches[_name].append(dict(zip(_names, args, strict=False)))

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield keys, launches
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


class Pool:
    """Sequences with their own blocks in a cache of 160 blocks; random steps over them."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.free = list(range(1, 160))
        self.rng.shuffle(self.free)

    def step(self, query_lens: list[int], cached: list[int]) -> ModelInput:
        inp = ModelInput()
        for q, c in zip(query_lens, cached, strict=True):
            length = c + q
            table = [self.free.pop() for _ in range(-(-length // BLOCK_SIZE))]
            positions = range(c, length)
            inp.input_ids += [self.rng.randrange(100) for _ in positions]
            inp.positions += positions
            inp.slot_mapping += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
            inp.query_lens.append(q)
            inp.context_lens.append(length)
            inp.block_tables.append(table)
            inp.logits_indices.append(len(inp.input_ids) - 1)
            self.free[:0] = table  # reused by later steps: contents do not matter here
        return inp


def run_steps(backend, impl, caches, steps: list[ModelInput]) -> None:
    gen = torch.Generator().manual_seed(0)
    for inp in steps:
        q, k, v = (torch.randn(inp.num_tokens, h, HEAD_DIM, generator=gen).to(DEVICE)
                   for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
        impl.forward(q, k, v, *caches, backend.build_metadata(inp, DEVICE))


def test_a_varied_run_compiles_no_variant_after_warm_up():
    backend = create_attention_backend("triton", DEVICE, BLOCK_SIZE)
    backend.num_sms = 16  # so that small decode batches split on the CPU too
    impl = backend.create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    caches = [torch.zeros(160, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE) for _ in range(2)]
    pool = Pool(seed=1)
    warm_up = [pool.step([5, 1], [0, 6]), pool.step([1], [9]), pool.step([1] * 8, [3] * 8)]
    rng = random.Random(2)
    varied = [pool.step([1], [2]), pool.step([1, 1], [62, 5])]  # block tables 1 and 16 wide
    for i in range(8):
        batch = rng.randint(1, 10)
        decode = i % 2 == 0
        query_lens = [1 if decode else rng.randint(1, 9) for _ in range(batch)]
        varied.append(pool.step(query_lens, [rng.choice([0, 1, 3, 15, 16, 31, 40]) for _ in range(batch)]))

    with recorded_keys() as (keys, _):
        run_steps(backend, impl, caches, warm_up)
        after_warm_up = {name: set(k) for name, k in keys.items()}
    with recorded_keys() as (keys, launches):
        run_steps(backend, impl, caches, varied)

    assert {name: len(k) for name, k in after_warm_up.items()} == {"store": 1, "prefill": 1, "decode": 2,
                                                                   "reduce": 1}
    for name in KERNELS:
        assert keys[name] <= after_warm_up[name], f"{name} compiled a new variant while serving"
    # the run was varied enough to matter: row strides of 1, of a multiple of 16 and others
    strides = {a["bt_stride"] for a in launches["decode"] + launches["prefill"]}
    splits = {a["num_splits"] for a in launches["decode"]}
    assert 1 in strides and any(s % 16 == 0 for s in strides) and len(strides) >= 4, strides
    assert 1 in splits and len(splits) >= 3, splits
