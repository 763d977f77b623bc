"""``TensorParallelExecutor.exact_rows`` combines what rank 0's runner answers (GGUF block kernels,
float layers) with the all-reduce's own limit, as ``ModelRunner.exact_rows`` combines its layers'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.engine.executor.executor import TensorParallelExecutor
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS


@pytest.mark.parametrize("runner, expected", [(None, MAX_FUSED_ROWS), (95, MAX_FUSED_ROWS),
                                              (MAX_FUSED_ROWS - 3, MAX_FUSED_ROWS - 3)])
def test_the_group_takes_the_fewer_of_its_runners_rows_and_the_all_reduces(runner, expected):
    group = SimpleNamespace(device=torch.device("cpu"), _rank_exact_rows=runner)
    assert TensorParallelExecutor.exact_rows(group) == expected


def test_any_count_on_a_gpu():
    group = SimpleNamespace(device=torch.device("cuda"), _rank_exact_rows=MAX_FUSED_ROWS - 3)
    assert TensorParallelExecutor.exact_rows(group) is None
