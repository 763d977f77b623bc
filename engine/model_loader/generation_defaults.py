"""The model's recommended sampling: what the service gives a request's unset SamplingParams
fields (as vLLM's API does with the model's generation config).

- A Hugging Face directory: the sampling fields its ``generation_config.json`` sets
  (temperature, top_p, top_k, min_p, repetition_penalty), nothing else.
- The bundled default model (a GGUF, which carries no generation config): its model card's
  recommendation, temperature 0.2 and top_p 0.9. At the API's plain default (temperature 1.0)
  this small model answers chat turns with gibberish.
- Anything else: no recommendation; SamplingParams' own defaults apply.
"""

from __future__ import annotations

import functools
import json
import os

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
BUNDLED_MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card


@functools.cache
def sampling_defaults(model: str) -> dict[str, float | int]:
    """The recommended sampling of ``model`` (the ``--model`` value), for unset fields only."""
    if model == "default":
        return dict(BUNDLED_MODEL_DEFAULTS)
    from kvserve.engine.model_loader.source import resolve_model  # torch and transformers: only when needed

    src = resolve_model(model)
    path = os.path.join(src.path, "generation_config.json")
    if src.gguf_file is not None or not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {k: config[k] for k in SAMPLING_KEYS if isinstance(config.get(k), int | float)}
