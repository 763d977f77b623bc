"""Speculative decoding under tensor parallelism: two ranks over the shared-memory channel (CPU).
Rank 0's engine proposes the drafts, lays the verification rows out and samples; the other rank
only runs the model on the ``ModelInput`` it is sent, so both apply the leader's decision. A
server with n-gram drafts on gives each request the tokens and log-probabilities a server with them
off gives it (greedy and seeded, each prompt alone), and drafts are both accepted and rejected.

Without the fused decode step (one rank only), that needs each projection to compute a
verification's rows as it computes a single decode row (``linear.compute_rows_alike``, which a
speculating runner turns on); before, rows 2..8 went through another GEMM and log-probabilities
moved in the last bit. The tiny random Llama (6 query heads, 2 KV heads: one KV head per rank)
under a small frequency penalty repeats each token a few times and moves on: prompt lookup drafts
from that. Its prompts are longer than 8 tokens: a shorter prefill would go through the row kernel
on the speculating server only."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.testing.engine import with_control_plane
from kvserve.testing.random_model import write_random_model

PROMPTS = [[(7 * j) % 50 + 100 for j in range(24)], [(13 * j) % 10240 for j in range(30)],
           [5, 6, 7, 8, 9] * 6]
SAMPLINGS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.3, logprobs=2),
    SamplingParams(temperature=0.5, top_k=40, seed=7, max_tokens=24, ignore_eos=True, frequency_penalty=0.3,
                   logprobs=2),
]


def _outputs(model, speculative: str) -> tuple[list, dict]:
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=2, max_num_seqs=4, max_model_len=256,
              num_kv_blocks=64, speculative=speculative)  # fmt: skip
    try:
        # drafts priced by a fixed step-cost table, not by what the start-up measured on a busy machine
        with_control_plane(llm, speculative=speculative)
        outs = [llm.generate([prompt], params, use_tqdm=False)[0]
                for params in SAMPLINGS for prompt in PROMPTS]
        assert llm.engine.is_healthy()
        logprobs = [[(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] for o in outs]
        return [(o.token_ids, lps) for o, lps in zip(outs, logprobs, strict=True)], llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.slow  # ~20 s: two two-rank engines (the single-process exactness tests stay in `make test`)
def test_speculation_at_tp2_gives_the_tokens_and_logprobs_of_plain_decoding(tmp_path):
    model = write_random_model("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    plain, _ = _outputs(model, "off")
    spec, stats = _outputs(model, "ngram")
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert spec == plain
