"""The benchmarks' ceiling: the ideal schedule's arithmetic, and real matmul timings that make sense."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvserve.benchmarks.instruments.ceiling import (
    MatmulCeiling,
    ideal_workload_time,
    kv_bytes_per_token,
    projection_shapes,
)


class LinearCost:
    """Matmul time proportional to the rows (1 ms per row), so the schedule's sums are exact."""

    def layers_time(self, rows: int) -> float:
        return rows * 1e-3

    def interpolated_decode_time(self, batch: int) -> float:
        return batch * 1e-3


def test_ideal_schedule_refills_slots_and_takes_the_slower_of_matmul_and_kv_reads():
    # two slots: request 1 (one token: its prefill's) leaves at once and request 2 takes its slot;
    # step 1 runs requests 0 and 2 over 11 + 31 cached tokens, step 2 request 0 alone over 12
    run = ideal_workload_time([10, 20, 30], [3, 1, 2], max_num_seqs=2, token_budget=100,
                              ceiling=LinearCost(), bandwidth=20_000.0, kv_bytes_token=1)
    assert run.prefill_rate == pytest.approx(1000.0)
    assert run.prefill_s == pytest.approx(60 / 1000)
    assert run.decode_steps == 2 and run.bandwidth_bound_steps == 1
    assert run.decode_s == pytest.approx(42 / 20_000 + 1e-3)  # KV-bound, then matmul-bound
    assert run.seconds == pytest.approx(run.prefill_s + run.decode_s)


def test_matmul_ceiling_measures_each_row_count_once_and_reads_the_ladder_between():
    """Structure only (wall times of a busy machine are no assertion): the shapes and KV bytes of a
    small Llama, a time measured once per row count and kept, a batch between two ladder steps read
    off the line between their measured times."""
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    assert projection_shapes(config) == [(256, 128), (128, 128), (512, 128), (128, 256)]
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 32 * 2
    assert kv_bytes_per_token(config, torch.bfloat16, "int8") == 2 * 2 * 2 * (32 + 4)  # int8 rows + scales
    ceiling = MatmulCeiling(config, torch.float32)
    one = ceiling.decode_step_time(1)
    assert 0 < one < float("inf") and ceiling.decode_step_time(1) == one  # measured once, then kept
    between = ceiling.interpolated_decode_time(40)  # read off the ladder between 32 and 48
    low, high = ceiling.decode_step_time(32), ceiling.decode_step_time(48)
    assert between == pytest.approx(low + (high - low) * (40 - 32) / (48 - 32))
    assert sorted(ceiling._layers_s) == sorted(ceiling._head_s) == [1, 32, 48]  # 40 itself never measured


def test_hybrid_projection_shapes_are_transformers_own():
    """A Qwen3.5 ceiling multiplies what each layer multiplies: the linear layers' in- and
    out-projections (summed over transformers' in_proj_qkv/z/b/a), the full-attention layers' q with
    its output gate; weights counted against a transformers model of the tiny shape."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from kvserve.testing.random_model import make_config

    config = make_config("qwen3.5-tiny")
    model = hf.Qwen3_5ForCausalLM(config)
    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if config.layer_types[i] == "linear_attention" else layer.self_attn
        linears = [m for m in [*mixer.modules(), *layer.mlp.modules()]
                   if isinstance(m, torch.nn.Linear)]
        want = sum(m.weight.numel() for m in linears)
        assert sum(o * k for o, k in projection_shapes(config, i)) == want, i
