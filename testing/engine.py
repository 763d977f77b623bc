"""Engine-level test helpers that reach into an ``LLM``'s control plane."""

from __future__ import annotations

from kvserve.engine import LLM
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler


def with_control_plane(llm: LLM, **changes) -> LLM:
    """Swap the engine's scheduler/block manager for ones built with other settings, over the
    same loaded model (loading costs seconds; these settings live only in the control plane)."""
    eng = llm.engine
    cfg = eng.config.replace(**changes)
    blocks = min(cfg.num_kv_blocks or eng.executor.num_kv_blocks, eng.executor.num_kv_blocks)
    eng.config = cfg
    eng.block_manager = BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)
    eng.scheduler = Scheduler(
        eng.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, eng.eos_token_ids
    )
    return llm
