"""The Triton attention backend against the torch backend, on the CPU under Triton's
interpreter: per layer over mixed steps (fresh prompts, chunk continuations, a prefix hit,
decodes), and through tiny random-weight Llama and Qwen3 models."""

import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvserve.kernels is first imported

pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

from kvserve.engine.layers.attention.backend import create_attention_backend  # noqa: E402
from kvserve.engine.model_input import ModelInput  # noqa: E402
from kvserve.engine.runner.cuda_graphs import decode_metadata  # noqa: E402

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class Seq:
    """A sequence's block table and how many of its tokens already have K/V in the cache."""

    def __init__(self, blocks: list[int], cached: int = 0):
        self.blocks, self.cached = blocks, cached


def step_input(seqs: list[Seq], new_tokens: list[int], vocab: int = 128, seed: int = 0) -> ModelInput:
    """The ModelInput of one step in which sequence i computes ``new_tokens[i]`` more tokens."""
    gen = torch.Generator().manual_seed(seed)
    inp = ModelInput()
    for seq, n in zip(seqs, new_tokens, strict=True):
        positions = list(range(seq.cached, seq.cached + n))
        inp.input_ids += torch.randint(vocab, (n,), generator=gen).tolist()
        inp.positions += positions
        inp.slot_mapping += [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        inp.query_lens.append(n)
        inp.context_lens.append(seq.cached + n)
        inp.block_tables.append(seq.blocks[: -(-(seq.cached + n) // BLOCK_SIZE)])
        inp.logits_indices.append(len(inp.input_ids) - 1)
        seq.cached += n
    return inp


def three_steps() -> list[ModelInput]:
    """Prefill (one prompt in two chunks), then a mixed step with a prefix-cache hit, then decode."""
    a, b, c = Seq([3, 7, 1]), Seq([0, 5, 9, 2]), Seq([6, 4])
    first = step_input([a, b, c], [7, 5, 3], seed=1)
    hit = Seq([3, 8], cached=BLOCK_SIZE)  # shares a's first block (same prompt start): only new tokens run
    second = step_input([a, b, c, hit], [1, 6, 1, 3], seed=2)
    third = step_input([a, b, c, hit], [1, 1, 1, 1], seed=3)
    return [first, second, third]


def random_qkv(tokens: int, gen: torch.Generator, dtype=torch.float32):
    shapes = [(tokens, heads, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS)]
    return [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for shape in shapes]


def paged_caches(dtype=torch.float32, gen: torch.Generator | None = None, backend=None):
    """K and V caches of 10 blocks, in ``backend``'s layout (the kernels' when None)."""
    shape = (10, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if backend is not None:
        shape = backend.kv_cache_shape(10, KV_HEADS, HEAD_DIM)
    if gen is None:
        return torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE)
    return [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]


SPLIT_CASES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 64)]


@pytest.mark.parametrize(("dtype", "num_sms"), SPLIT_CASES)
def test_triton_layer_matches_torch_layer_over_mixed_steps(dtype, num_sms):
    """With 64 SMs the decode step takes the split path (16 splits for 4 sequences x 2 KV heads;
    at these lengths only the first split holds keys, and the reduce must ignore the empty ones)."""
    backends = {name: create_attention_backend(name, DEVICE, BLOCK_SIZE) for name in ("torch", "triton")}
    backends["triton"].num_sms = num_sms
    impls = {name: b.create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5) for name, b in backends.items()}
    caches = {name: paged_caches(dtype, backend=b) for name, b in backends.items()}
    gen = torch.Generator().manual_seed(0)
    for inp in three_steps():
        q, k, v = random_qkv(inp.num_tokens, gen, dtype)
        outs = {}
        for name, backend in backends.items():
            meta = backend.build_metadata(inp, DEVICE)
            outs[name] = impls[name].forward(q, k, v, *caches[name], meta)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (outs["triton"].float() - outs["torch"].float()).abs().max().item() <= tol
        for triton_cache, torch_cache in zip(caches["triton"], caches["torch"], strict=True):
            assert torch.equal(triton_cache, torch_cache.permute(1, 2, 0, 3))  # torch's is head-major


@pytest.mark.parametrize("num_sms", [None, 64])
def test_triton_window_layer_matches_torch_and_reads_no_block_behind_the_window(num_sms):
    """A window of 3 keys over the mixed steps; before the decode step the blocks wholly behind
    every sequence's window (3, shared by two sequences, and 5) hold NaN, as freed blocks reused
    by others may hold anything: neither backend reads them, unsplit or split (16 splits)."""
    backends = {name: create_attention_backend(name, DEVICE, BLOCK_SIZE) for name in ("torch", "triton")}
    backends["triton"].num_sms = num_sms
    impls = {name: b.create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=3)
             for name, b in backends.items()}
    caches = {name: paged_caches(backend=b) for name, b in backends.items()}
    gen = torch.Generator().manual_seed(0)
    for i, inp in enumerate(three_steps()):
        if i == 2:
            for name, (k_cache, v_cache) in caches.items():
                blocks = (slice(None), [3, 5]) if name == "torch" else ([3, 5],)
                k_cache[blocks] = v_cache[blocks] = float("nan")
        q, k, v = random_qkv(inp.num_tokens, gen)
        outs = {name: impls[name].forward(q, k, v, *caches[name], backend.build_metadata(inp, DEVICE))
                for name, backend in backends.items()}
        assert not outs["triton"].isnan().any()
        assert (outs["triton"] - outs["torch"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_sms", [None, 64])
@pytest.mark.parametrize(("window", "cap", "with_sinks"),
                         [(None, 2.0, False), (None, None, True), (3, 2.0, True)])
def test_triton_soft_cap_and_sinks_match_the_torch_layer(window, cap, with_sinks, num_sms):
    """Gemma 2's soft cap (2.0: small enough to bend these scores) and gpt-oss's sinks, alone and
    with a window, over the mixed steps: the prefill kernel and the decode, unsplit and split (the
    sink counted once, in the first split). The torch layer is checked against a float64
    reference in test_attention_variants.py."""
    backends = {name: create_attention_backend(name, DEVICE, BLOCK_SIZE) for name in ("torch", "triton")}
    backends["triton"].num_sms = num_sms
    variant = dict(sliding_window=window, logits_soft_cap=cap, sinks=with_sinks)
    impls = {name: b.create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, **variant)
             for name, b in backends.items()}
    caches = {name: paged_caches(backend=b) for name, b in backends.items()}
    gen = torch.Generator().manual_seed(0)
    sinks = {"sinks": torch.randn(HEADS, generator=gen).mul(2).to(DEVICE)} if with_sinks else {}
    for inp in three_steps():
        q, k, v = random_qkv(inp.num_tokens, gen)
        outs = {name: impls[name].forward(q * 4, k, v, *caches[name], backend.build_metadata(inp, DEVICE),
                                          **sinks)
                for name, backend in backends.items()}
        assert (outs["triton"] - outs["torch"]).abs().max().item() <= 1e-5
    plain = backends["triton"].create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=window)
    meta = backends["triton"].build_metadata(inp, DEVICE)
    assert (plain.forward(q * 4, k, v, *caches["triton"], meta) - outs["triton"]).abs().max() > 1e-2  # bites


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host-device synchronisation exists only on a GPU")
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_steps_metadata_and_attention_never_wait_for_the_gpu(name):
    """Every host-to-device copy of a step's metadata goes through pinned memory without blocking;
    torch's sync debug mode turns any synchronising call into an error."""
    backend = create_attention_backend(name, DEVICE, BLOCK_SIZE)
    impl = backend.create_impl(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    caches = paged_caches()
    gen = torch.Generator().manual_seed(0)
    steps = [(inp, random_qkv(inp.num_tokens, gen)) for inp in three_steps()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inp, (q, k, v) in steps:
            impl.forward(q, k, v, *caches, backend.build_metadata(inp, DEVICE))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_inputs(inp: ModelInput, meta):
    """A decode step's inputs in the form the CUDA-graph runner takes."""
    from kvserve.engine.runner.cuda_graphs import DecodeInputs

    ids, positions = (torch.tensor(x, device=DEVICE) for x in (inp.input_ids, inp.positions))
    return DecodeInputs(ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)


def test_graph_decode_metadata_over_padded_static_buffers_gives_the_same_rows():
    """What a captured decode graph sees: metadata over static views, extra rows padded."""
    from kvserve.engine.runner.cuda_graphs import allocate_static_inputs, copy_padded

    backend = create_attention_backend("triton", DEVICE, BLOCK_SIZE)
    impl = backend.create_impl(HEADS, KV_HEADS, HEAD_DIM, 0.25)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = paged_caches(gen=gen)
    inp = three_steps()[2]
    q, k, v = random_qkv(4, gen)
    meta = backend.build_metadata(inp, DEVICE)
    expected = impl.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)

    padded = copy_padded(allocate_static_inputs(8, 5, DEVICE), graph_inputs(inp, meta), bucket=8)
    pad = lambda x: torch.cat([x, torch.zeros(4, *x.shape[1:], dtype=x.dtype, device=DEVICE)])
    out = impl.forward(pad(q), pad(k), pad(v), k_cache, v_cache, decode_metadata(padded, BLOCK_SIZE))

    torch.testing.assert_close(out[:4], expected)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))  # padded rows attend to nothing


# ---------------------------------------------------------------- whole tiny models


def tiny_config(architecture: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=128, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                  tie_word_embeddings=True)  # fmt: skip
    if architecture == "qwen3":
        return Qwen3Config(**common, head_dim=HEAD_DIM, architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**common, architectures=["LlamaForCausalLM"])


def build_tiny_model(config, backend, device: torch.device):
    from kvserve.engine.model_loader.checkpoint import init_random_weights
    from kvserve.engine.models import build_model

    model = build_model(config, torch.float32, device, backend=backend)
    init_random_weights(model, seed=0)
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in model.attention_layers():
        shape = backend.kv_cache_shape(10, config.num_key_value_heads, head_dim)
        layer.bind_kv_cache(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
    return model


@torch.no_grad()
def forward_step(model, backend, inp: ModelInput, device: torch.device) -> torch.Tensor:
    ids, positions = (torch.tensor(x, device=device) for x in (inp.input_ids, inp.positions))
    return model(ids, positions, backend.build_metadata(inp, device))


def run_model(config, backend_name: str, steps: list[ModelInput], device: torch.device) -> list[torch.Tensor]:
    """Logits of each step's last token per sequence."""
    backend = create_attention_backend(backend_name, device, BLOCK_SIZE)
    model = build_tiny_model(config, backend, device)
    logits = []
    for inp in steps:
        hidden = forward_step(model, backend, inp, device)
        logits.append(model.compute_logits(hidden[inp.logits_indices]).cpu())
    return logits


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tiny_model_on_triton_backend_matches_cpu_torch_backend(architecture):
    """On a GPU: the compiled kernels on the GPU against the CPU reference of the same machine;
    on the CPU: the interpreted kernels against the torch backend."""
    config = tiny_config(architecture)
    steps = three_steps()
    reference = run_model(config, "torch", steps, torch.device("cpu"))
    candidate = run_model(config, "triton", steps, DEVICE)
    for expected, actual in zip(reference, candidate, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # greedy choice is well defined there
        assert clear.any()
        assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("num_sms", [None, 32])
def test_decode_graph_replay_of_a_tiny_model_matches_its_eager_decode(num_sms):
    """CudaGraphRunner over a real model: real CUDA graphs on a GPU; on the CPU a recorder
    whose replay re-runs the captured body on the same static buffers. With 32 SMs every
    captured size splits its contexts (2 to 16 splits), through the one shared workspace."""
    from types import SimpleNamespace

    from kvserve.engine.runner.cuda_graphs import CudaGraphRunner, record_cuda_graph

    backend = create_attention_backend("triton", DEVICE, BLOCK_SIZE)
    backend.num_sms = num_sms
    model = build_tiny_model(tiny_config("llama"), backend, DEVICE)
    prefill, mixed, decode = three_steps()
    forward_step(model, backend, prefill, DEVICE)
    forward_step(model, backend, mixed, DEVICE)
    eager = forward_step(model, backend, decode, DEVICE)  # writes the decode K/V; a replay rewrites the same

    fake = lambda body, pool: SimpleNamespace(replay=body, pool=lambda: None)
    runner = CudaGraphRunner(
        model, lambda inputs: decode_metadata(inputs, BLOCK_SIZE), max_num_seqs=6, max_model_len=40,
        block_size=BLOCK_SIZE, device=DEVICE, record=record_cuda_graph if DEVICE.type == "cuda" else fake,
    )  # fmt: skip
    runner.capture()
    replayed = runner.replay(graph_inputs(decode, backend.build_metadata(decode, DEVICE)))

    assert runner.captured == [1, 2, 4, 8] and replayed.shape == eager.shape
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    assert (backend.workspace is not None) == (num_sms == 32)
    runner.close()
