"""What the machine allows a model: the ceiling the benchmarks print next to kvserve's figures.

Measured in the same process as the run it judges (same threads, same load on the machine):

- ``MatmulCeiling``: the time of the model's weight multiplications alone at a number of rows —
  q|k|v, o, gate|up and down of every layer with weights of the model's shapes (one tensor per
  layer, so nothing stays in cache that would not in the real model), plus the LM head over the
  sampled rows. No attention, no norms, no sampling, no overhead. They run as the engine runs
  them (``engine/layers/cpu_matmul.py`` ``linear``: one row through the C kernel, bfloat16 on the CPU
  with oneDNN-blocked weights), so ``step / matmul`` is what a step adds to its multiplications;
  ``plain=True`` times plain ``F.linear`` instead (what the engine did before it blocked them).
- ``memory_bandwidth``: bytes per second of a sum over 1 GiB (what reading the KV cache costs).
- ``ideal_workload_time``: a workload of prompts and output lengths scheduled the ideal way
  (``max_num_seqs`` running at once, a request enters when one leaves): its prefill at the matmul
  rate of a full token budget, plus every decode step at max(matmul time at its batch, the KV
  bytes it reads / memory bandwidth).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.engine.layers.cpu_matmul import linear, pack_weight
from kvserve.kernels.cpu.abi import cache_row_width

GiB = 1 << 30
BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` runs after one warm-up (the least disturbed one on a
    shared machine)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def projection_shapes(hf_config, layer: int = 0) -> list[tuple[int, int]]:
    """(out_features, in_features) of decoder layer ``layer``'s four projections, one rank, no TP.
    In a linear-attention hybrid (``layer_types`` naming ``linear_attention``: Qwen3.5, Qwen3-Next)
    a linear layer's are its in-projection (conv channels, z, b and a) and out-projection, and a
    full-attention layer's q projection also gives the output gate (twice the heads)."""
    hidden = hf_config.hidden_size
    inter = hf_config.intermediate_size
    mlp = [(2 * inter, hidden), (hidden, inter)]
    kinds = getattr(hf_config, "layer_types", None) or ()
    if "linear_attention" in kinds:
        values = hf_config.linear_num_value_heads * hf_config.linear_value_head_dim
        if kinds[layer] == "linear_attention":
            keys = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
            return [(2 * keys + 2 * values + 2 * hf_config.linear_num_value_heads, hidden), (hidden, values),
                    *mlp]
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    gated = 2 if "linear_attention" in kinds else 1
    return [(gated * q + 2 * kv, hidden), (hidden, q), *mlp]


def kv_bytes_per_token(hf_config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token over every layer, in a cache of the model's ``dtype`` or an int8 one."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    row = cache_row_width(head_dim, True) if kv_cache_dtype == "int8" else head_dim * dtype.itemsize
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * row


class MatmulCeiling:
    """Matmul-only time of one forward pass at a number of rows, measured once per row count."""

    @property
    def blocked(self) -> bool:
        """Whether the weights are multiplied in oneDNN's blocked layout (not ``plain``)."""
        return self.lm_head[1] is not None

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device | str = "cpu",
                 plain: bool = False):
        self.device = torch.device(device)
        self.dtype = dtype
        def make(*shape):  # (weight, its blocked copy or None)
            w = torch.randn(*shape, dtype=dtype, device=self.device) * 0.02
            return w, None if plain else pack_weight(w)

        self.layers = [[make(*s) for s in projection_shapes(hf_config, i)]
                       for i in range(hf_config.num_hidden_layers)]
        self.lm_head = make(hf_config.vocab_size, hf_config.hidden_size)
        self.hidden = hf_config.hidden_size
        self._layers_s: dict[int, float] = {}
        self._head_s: dict[int, float] = {}

    def layers_time(self, rows: int) -> float:
        """Seconds for every layer's projections over ``rows`` tokens (measured once per count)."""
        if rows not in self._layers_s:
            self._layers_s[rows] = self.measure_layers(rows)
        return self._layers_s[rows]

    def lm_head_time(self, rows: int) -> float:
        if rows not in self._head_s:
            self._head_s[rows] = self.measure_lm_head(rows)
        return self._head_s[rows]

    def measure_layers(self, rows: int) -> float:
        """``layers_time`` measured afresh: for a caller that interleaves it with its own timings."""
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=self.dtype, device=self.device)
                  for layer in self.layers for w, _ in layer}

        def run() -> None:
            for layer in self.layers:
                for w, packed in layer:
                    linear(inputs[w.shape[1]], w, None, packed)

        return best_time(run, self.device)

    def measure_lm_head(self, rows: int) -> float:
        x = torch.randn(rows, self.hidden, dtype=self.dtype, device=self.device)
        w, packed = self.lm_head
        return best_time(lambda: linear(x, w, None, packed), self.device)

    def measure_decode_step(self, rows: int) -> float:
        """``decode_step_time`` measured afresh."""
        return self.measure_layers(rows) + self.measure_lm_head(rows)

    def decode_step_time(self, batch: int) -> float:
        """A decode step's matmuls: ``batch`` rows through the layers and the LM head."""
        return self.layers_time(batch) + self.lm_head_time(batch)

    def interpolated_decode_time(self, batch: int) -> float:
        """``decode_step_time`` read off the batch ladder (measured at its sizes, linear between),
        so that a workload passing through every batch size costs a few measurements, not one each."""
        if batch in BATCH_LADDER or batch > BATCH_LADDER[-1]:
            return self.decode_step_time(batch)
        hi = bisect.bisect(BATCH_LADDER, batch)
        a, b = BATCH_LADDER[hi - 1], BATCH_LADDER[hi]
        ta, tb = self.decode_step_time(a), self.decode_step_time(b)
        return ta + (tb - ta) * (batch - a) / (b - a)


def memory_bandwidth(device: torch.device | str = "cpu", nbytes: int = GiB) -> float:
    """Read bandwidth in bytes/s: the fastest of a few sums over ``nbytes``."""
    device = torch.device(device)
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = best_time(lambda: data.sum(), device, repeats=3)
    return nbytes / seconds


@dataclass
class IdealRun:
    seconds: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    bandwidth_bound_steps: int  # steps where reading the KV cache, not the matmuls, sets the time
    prefill_rate: float  # tokens/s of the matmuls at a full token budget


def ideal_workload_time(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                        token_budget: int, ceiling: MatmulCeiling, bandwidth: float,
                        kv_bytes_token: int) -> IdealRun:
    """The workload's time if every step cost only what the machine must spend on it.

    Each request's prefill yields its first token; every further token is one decode step shared
    with the requests running beside it. At most ``max_num_seqs`` run; the next waiting request
    enters as soon as one finishes."""
    prefill_rate = token_budget / ceiling.layers_time(token_budget)
    prefill_s = sum(prompt_lens) / prefill_rate
    waiting = list(range(len(prompt_lens)))[::-1]
    running: dict[int, int] = {}  # request -> tokens generated so far
    decode_s, steps, bw_bound = 0.0, 0, 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running[waiting.pop()] = 1  # the prefill's token
        done = [i for i, n in running.items() if n >= output_lens[i]]
        if done:  # their slots go to waiting requests before the next step
            for i in done:
                del running[i]
            continue
        kv_read = sum(prompt_lens[i] + n for i, n in running.items()) * kv_bytes_token
        matmul = ceiling.interpolated_decode_time(len(running))
        step = max(matmul, kv_read / bandwidth)
        bw_bound += step > matmul
        decode_s += step
        steps += 1
        for i in running:
            running[i] += 1
    return IdealRun(prefill_s + decode_s, prefill_s, decode_s, steps, bw_bound, prefill_rate)
