"""Engine-level test helpers that reach into an ``LLM``'s control plane."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.layers.cpu_matmul import compute_rows_alike
from kvserve.engine.model_input import ModelInput
from kvserve.engine.spec_decode.policy import StepCosts
from kvserve.engine.spec_decode.speculator import Speculator
from kvserve.testing.random_model import make_config, write_model_dir

# a step-cost table under which drafting up to 8 rows is nearly free: tests of speculation then do
# not depend on what the start-up measurement gave on a busy machine
FLAT_STEP_COSTS = StepCosts({1: 1.0, 8: 1.05, 9: 4.0, 64: 20.0})


def with_control_plane(llm: LLM, step_costs: StepCosts = FLAT_STEP_COSTS, **changes) -> LLM:
    """Swap the engine's scheduler/block manager (and speculator) for ones built with other
    settings, over the same loaded model (loading costs seconds; these settings live only in the
    control plane; a runner that was built not speculating gets the switch one built speculating
    has, ``compute_rows_alike``; a hybrid's state slots as the executor holds them)."""
    eng = llm.engine
    cfg = eng.config.replace(**changes)
    eng.speculator = (None if cfg.speculative == "off"
                      else Speculator(cfg, step_costs, eng.executor.exact_rows()))
    runner = eng.executor  # in process: speculating, its float projections compute rows alike, as a
    if cfg.speculative != "off" and getattr(runner, "rows_alike", False) is None:  # runner built so does
        runner.rows_alike = compute_rows_alike(runner.model)
    blocks = min(cfg.num_kv_blocks or eng.executor.num_kv_blocks, eng.executor.num_kv_blocks)
    eng.config = cfg
    eng.block_manager = BlockManager(
        blocks, cfg.block_size, cfg.enable_prefix_caching, windows=eng.executor.kv_groups.windows,
        state_slots=eng.executor.num_state_slots,
        state_snapshots=eng.executor.num_state_snapshots if cfg.enable_prefix_caching else 0)
    eng.scheduler = Scheduler(
        eng.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, eng.eos_token_ids,
        last_prompt_token_alone=cfg.enable_prefix_caching,
    )
    return llm


def sequence_step(ids: list[int], start: int, tables: list[list[int]], block: int, all_logits: bool = True,
                  state_slots: list[int] | None = None) -> ModelInput:
    """One sequence's tokens ``ids`` at positions ``start``.. straight to a model runner, through the
    paged cache at ``tables`` (one block table per KV cache group; a model of fewer groups reads the
    first ones only) with blocks of ``block`` tokens; logits of every token or of the last only;
    ``state_slots`` for a model with a state cache (then one group)."""
    end = start + len(ids)
    slots = [[table[p // block] * block + p % block for p in range(start, end)] for table in tables]
    extra = ({"state_slots": state_slots} if state_slots is not None else
             {"group_slot_mappings": slots[1:], "group_block_tables": [[table] for table in tables[1:]]})
    return ModelInput(input_ids=ids, positions=list(range(start, end)), query_lens=[len(ids)],
                      context_lens=[end], block_tables=[tables[0]], slot_mapping=slots[0],
                      logits_indices=list(range(len(ids))) if all_logits else [len(ids) - 1], **extra)


# a hybrid's linear layers' projections, times this: N(0, 0.02) weights leave their output too small
# to matter, the tokens would not depend on the recurrent state
LINEAR_SCALE = {"in_proj_qkv": 20.0, "in_proj_z": 20.0, "in_proj_qkvz": 20.0, "out_proj": 20.0,
                "conv1d": 20.0}


def scaled_hybrid_model(name: str, out_dir, **overrides) -> str:
    """A tiny random Qwen3.5 / Qwen3-Next checkpoint (float32) whose linear layers steer the tokens
    (``overrides``: of the config's fields)."""
    path = write_model_dir(make_config(name, **overrides), out_dir, dtype=torch.float32)
    weights = load_file(str(path / "model.safetensors"))
    for key in weights:
        for part, scale in LINEAR_SCALE.items():
            if f"linear_attn.{part}." in key:
                weights[key] = weights[key] * scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


# the hybrids' parity tests (tests/engine/models/test_hybrid_*.py): blocks of 16 tokens, prompts of a
# few hundred tokens (past several 64-token blocks of the chunked rule), 12 greedy tokens each
HYBRID_BLOCK = 16
HYBRID_PROMPTS = [[(37 * i + 11) % 9000 + 3 for i in range(300)], list(range(2000, 2200)),
                  [(i * i) % 5000 + 7 for i in range(137)], [42] * 65]
HYBRID_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_greedy(path: str, prompts, max_new_tokens: int = 12) -> list[list[int]]:
    """Transformers' greedy tokens of each prompt alone (every tensor of the checkpoint read)."""
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def greedy_tokens(llm: LLM, prompts, params: SamplingParams = HYBRID_GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_slots_all_free(llm: LLM) -> None:
    """Every state slot is back in the pool and the block manager's books balance."""
    stats = llm.stats()
    assert 0 < stats.state_slots_free == stats.state_slots_total
    llm.engine.block_manager.check_integrity()


# bases of ``echo_prompts`` (base + changed continuation + base: 84 to 104 tokens) and the greedy
# parameters their speculation tests decode with
ECHO_BASES = [[(37 * i + 11) % 9000 + 3 for i in range(40)], list(range(300, 330)),
              [(i * i) % 5000 + 7 for i in range(33)], [42] * 20 + [43, 44] * 10]
ECHO_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def assert_partly_rejected(stats, before=None) -> None:
    """Verifications (since ``before``'s stats) kept some drafts and rolled the others back."""
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    if before is not None:
        drafted -= before.spec_decode_num_draft_tokens
        accepted -= before.spec_decode_num_accepted_tokens
    assert 0 < accepted < drafted


def echo_prompts(llm: LLM, bases, max_tokens: int = 24) -> list[list[int]]:
    """Prompts n-gram drafts are partly right on: base + (``llm``'s greedy continuation of base, every
    fifth token changed) + base. A tiny model's linear layers forget fast, so after the second base it
    continues as after the first, and drafts copied from the changed continuation are kept up to each
    changed token: verifications accept some drafts and reject the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    continuations = greedy_tokens(llm, bases, params)
    changed = [[t + 1 if i % 5 == 4 else t for i, t in enumerate(c)] for c in continuations]
    return [base + c + base for base, c in zip(bases, changed, strict=True)]
