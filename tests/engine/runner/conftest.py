"""The tiny random Llama the runner tests over decode graphs run."""

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    return write_random_model("llama-tiny", tmp_path_factory.mktemp("llama-tiny"), dtype=torch.float32)
