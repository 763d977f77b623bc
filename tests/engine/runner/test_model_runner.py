"""ModelRunner and the models against Hugging Face transformers on the same weights (float32, CPU).

The ModelInputs are built by hand with explicit block tables, so these tests pin down the
paged cache itself: prefill, decode through the cache, chunked prefill over cached context,
mixed batches, and slot -1.
"""

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.attention.backend import create_attention_backend
from kvserve.engine.model_input import ModelInput
from kvserve.engine.model_loader.checkpoint import init_random_weights, random_weights
from kvserve.engine.models import build_model
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.engine.runner.step_inputs import prepare_inputs

BLOCK = 16
PROMPT = (
    "The river carried boats of grain, salt and timber to the markets of the coast, "
    "where merchants from distant cities gathered every spring to trade wool, copper and olive oil "
    "before the storms."
)


@pytest.fixture(scope="module")
def runner():
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=BLOCK))
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


@pytest.fixture(scope="module")
def prompt_ids(default_source):
    from kvserve.engine.tokenizer.load import load_tokenizer

    ids = load_tokenizer(default_source)(PROMPT).input_ids
    assert 30 <= len(ids) <= 48
    return ids


class Seq:
    """One sequence of a hand-built batch: its tokens so far and its blocks."""

    def __init__(self, blocks: list[int]):
        self.blocks = blocks
        self.num_cached = 0

    def chunk(self, new_ids: list[int], store: bool = True) -> dict:
        start = self.num_cached
        self.num_cached += len(new_ids)
        positions = list(range(start, self.num_cached))
        slots = [self.blocks[p // BLOCK] * BLOCK + p % BLOCK if store else -1 for p in positions]
        return dict(ids=new_ids, positions=positions, slots=slots, context=self.num_cached,
                    blocks=self.blocks)


def batch(*chunks: dict, all_logits: bool = False) -> ModelInput:
    inp = ModelInput()
    for c in chunks:
        if all_logits:
            inp.logits_indices += range(len(inp.input_ids), len(inp.input_ids) + len(c["ids"]))
        else:
            inp.logits_indices.append(len(inp.input_ids) + len(c["ids"]) - 1)
        inp.input_ids += c["ids"]
        inp.positions += c["positions"]
        inp.slot_mapping += c["slots"]
        inp.query_lens.append(len(c["ids"]))
        inp.context_lens.append(c["context"])
        inp.block_tables.append(c["blocks"])
    return inp


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_runner_reports_what_it_loaded(runner):
    assert runner.vocab_size == 49152 and runner.hf_config.num_hidden_layers == 30
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    assert runner.attention_backend_name == "torch"
    assert (runner.num_kv_blocks, runner.block_size) == (64, BLOCK)
    assert runner.kv_cache.shape == (2, 30, 3, 64, BLOCK, 64)  # the torch backend's head-major layout


def test_prefill_logits_match_transformers(runner, hf_model, prompt_ids):
    ours = runner.execute_model(batch(Seq([5, 9, 2]).chunk(prompt_ids), all_logits=True))
    theirs = hf_logits(hf_model, prompt_ids)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (len(prompt_ids), 49152)
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


def test_greedy_decode_through_the_paged_cache_matches_transformers(runner, hf_model, prompt_ids):
    steps = 8
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=steps, do_sample=False,
                                     min_new_tokens=steps)[0, len(prompt_ids):].tolist()
    seq = Seq([11, 4, 30, 7])  # scattered blocks, in no particular order
    logits = runner.execute_model(batch(seq.chunk(prompt_ids)))
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        logits = runner.execute_model(batch(seq.chunk(tokens[-1:])))
    assert tokens == expected


@pytest.mark.parametrize("blocks", [[40, 41, 42], [42, 17, 40]], ids=["consecutive", "scattered"])
def test_prompt_in_two_chunks_gives_the_logits_of_one_pass(runner, prompt_ids, blocks):
    """The second chunk reads the first from the cache: as a view of consecutive blocks, or
    through a gather of scattered ones."""
    whole = runner.execute_model(batch(Seq([1, 2, 3]).chunk(prompt_ids)))
    seq = Seq(blocks)
    runner.execute_model(batch(seq.chunk(prompt_ids[:21])))  # ends inside a block
    second = runner.execute_model(batch(seq.chunk(prompt_ids[21:])))
    torch.testing.assert_close(second, whole, atol=1e-4, rtol=1e-4)


def test_mixed_batch_gives_each_sequence_its_logits_alone(runner, prompt_ids):
    # a and c decode with contexts of very different length (they attend in separate groups)
    a_prompt, b_prompt, c_prompt = prompt_ids[:30], prompt_ids[5:], prompt_ids[:4]
    a, c = Seq([20, 21]), Seq([25])
    runner.execute_model(batch(a.chunk(a_prompt), c.chunk(c_prompt)))
    a_alone = runner.execute_model(batch(Seq([50, 51]).chunk(a_prompt + [42]))).squeeze(0)
    b_alone = runner.execute_model(batch(Seq([52, 53, 54]).chunk(b_prompt))).squeeze(0)
    c_alone = runner.execute_model(batch(Seq([55]).chunk(c_prompt + [7]))).squeeze(0)
    # decode, prefill, decode: the decode rows are not contiguous in the flat batch
    mixed = runner.execute_model(batch(a.chunk([42]), Seq([30, 31, 32]).chunk(b_prompt), c.chunk([7])))
    for ours, alone in zip(mixed, (a_alone, b_alone, c_alone), strict=True):
        torch.testing.assert_close(ours, alone, atol=1e-4, rtol=1e-4)


def test_slot_minus_one_leaves_the_cache_untouched(runner, prompt_ids):
    block_60 = runner.kv_cache[:, :, :, 60]  # [K/V, layer, kv head, block, ...]
    block_60.fill_(3.0)
    before = block_60.clone()
    seq = Seq([60, 61, 62])
    runner.execute_model(batch(seq.chunk(prompt_ids[:10], store=False)))
    assert torch.equal(block_60, before)


def test_prepare_inputs_lays_out_the_common_attention_metadata(runner):
    inp = batch(Seq([3, 8]).chunk(list(range(20))), Seq([5]).chunk([1]))
    meta = prepare_inputs(inp, runner.backend, runner.device).attn_metadata
    assert meta.query_start_loc.tolist() == [0, 20, 21]
    assert meta.seq_lens.tolist() == [20, 1] and meta.block_tables.tolist() == [[3, 8], [5, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decode_tokens) == (20, 20, 1)


def test_random_qwen3_matches_transformers_qwen3_with_the_same_weights():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    backend = create_attention_backend("torch", torch.device("cpu"), BLOCK)
    ours = build_model(config, torch.float32, "cpu", backend=backend)
    init_random_weights(ours, seed=3)
    theirs = Qwen3ForCausalLM(config).eval()
    missing, unexpected = theirs.load_state_dict(dict(random_weights(config, seed=3)), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding

    ids = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31]
    bind_fresh_kv_cache(ours, backend, num_blocks=4, kv_heads=2, head_dim=16)
    seq = Seq([3, 1])
    first = run_model(ours, backend, batch(seq.chunk(ids[:9]), all_logits=True))
    rest = run_model(ours, backend, batch(seq.chunk(ids[9:]), all_logits=True))  # context from the cache
    torch.testing.assert_close(torch.cat([first, rest]), hf_logits(theirs, ids), atol=1e-4, rtol=1e-4)


def test_qwen2_hf_directory_through_the_runner_matches_transformers(tiny_qwen2_dir):
    from transformers import Qwen2ForCausalLM

    theirs = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", num_kv_blocks=8,
                                      block_size=BLOCK))
    ids = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31, 400, 2, 8, 8, 9]
    seq = Seq([6, 2])
    prefill = runner.execute_model(batch(seq.chunk(ids[:-1]), all_logits=True))
    decode = runner.execute_model(batch(seq.chunk(ids[-1:])))
    runner.shutdown()
    torch.testing.assert_close(torch.cat([prefill, decode]), hf_logits(theirs, ids), atol=1e-4, rtol=1e-4)


def test_memory_sizing_warm_up_step_is_a_valid_largest_prefill(tiny_qwen2_dir):
    """The step the GPU sizing runs to measure peak activations (its logic runs on any device)."""
    runner = ModelRunner(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", max_model_len=128,
                                      max_num_batched_tokens=300, num_kv_blocks=32, block_size=BLOCK))
    warm_up = runner._warm_up_input()
    assert warm_up.query_lens == warm_up.context_lens == [128, 128, 44]
    assert len(set(warm_up.slot_mapping)) == 300 and min(warm_up.slot_mapping) >= 0
    logits = runner.execute_model(warm_up)
    runner.shutdown()
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


def bind_fresh_kv_cache(model, backend, num_blocks: int, kv_heads: int, head_dim: int) -> None:
    layers = model.attention_layers()
    kv = torch.zeros(2, len(layers), *backend.kv_cache_shape(num_blocks, kv_heads, head_dim))
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(kv[0, i], kv[1, i])


@torch.inference_mode()
def run_model(model, backend, inp: ModelInput) -> torch.Tensor:
    prepared = prepare_inputs(inp, backend, torch.device("cpu"))
    hidden = model(prepared.input_ids, prepared.positions, prepared.attn_metadata)
    return model.compute_logits(hidden[prepared.logits_indices])
