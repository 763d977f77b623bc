"""Engine-level test helpers that reach into an ``LLM``'s control plane."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from kvserve.engine import LLM
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
    has, ``compute_rows_alike``)."""
    eng = llm.engine
    cfg = eng.config.replace(**changes)
    eng.speculator = (None if cfg.speculative == "off"
                      else Speculator(cfg, step_costs, eng.executor.exact_rows()))
    runner = eng.executor  # in process: speculating, its float projections compute rows alike, as a
    if cfg.speculative != "off" and getattr(runner, "rows_alike", False) is None:  # runner built so does
        runner.rows_alike = compute_rows_alike(runner.model)
    blocks = min(cfg.num_kv_blocks or eng.executor.num_kv_blocks, eng.executor.num_kv_blocks)
    eng.config = cfg
    eng.block_manager = BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching,
                                     windows=eng.executor.kv_groups.windows)
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


def scaled_hybrid_model(name: str, out_dir) -> str:
    """A tiny random Qwen3.5 / Qwen3-Next checkpoint (float32) whose linear layers steer the tokens."""
    path = write_model_dir(make_config(name), out_dir, dtype=torch.float32)
    weights = load_file(str(path / "model.safetensors"))
    for key in weights:
        for part, scale in LINEAR_SCALE.items():
            if f"linear_attn.{part}." in key:
                weights[key] = weights[key] * scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)
