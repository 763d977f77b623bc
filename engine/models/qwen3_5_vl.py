"""Qwen3.5 as the Hub ships it (``Qwen3_5ForConditionalGeneration``): a vision tower
(``model.visual.*``) beside the text decoder (``model.language_model.*``, settings under
``text_config``). kvserve serves the text model, as vLLM does for text-only use: the config is the
text config (``served_config``), the text weights load under Qwen3.5's names, the vision tower's and
the multi-token-prediction head's (``mtp.*``) are skipped, and a prompt is text or token ids only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator

from torch import Tensor

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import AttentionBackend
from kvserve.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from kvserve.engine.models.registry import register_model

log = logging.getLogger("kvserve.engine.models")


@register_model
class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    skipped_prefixes = ("model.visual.", "mtp.")  # the vision tower; the multi-token-prediction head

    @staticmethod
    def served_config(hf_config):
        """The text config the model runs on, under this architecture's name; the composite's
        ``tie_word_embeddings`` (its lm_head is tied at the top level). A text config is kept."""
        text = getattr(hf_config, "text_config", None)
        if text is None:
            return hf_config
        served = copy.deepcopy(text)
        served.architectures = list(hf_config.architectures)
        served.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        return served

    @staticmethod
    def refuse_unsupported(hf_config) -> None:
        Qwen3_5ForCausalLM.refuse_unsupported(Qwen3_5ForConditionalGeneration.served_config(hf_config))

    def __init__(self, config, backend: AttentionBackend, parallel: ParallelContext | None = None):
        super().__init__(self.served_config(config), backend, parallel)
        log.info("Qwen3_5ForConditionalGeneration: serving the text model; the vision tower is not loaded "
                 "and images are not served")

    def transform_checkpoint(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The text decoder's tensors under Qwen3.5's names; the vision tower and MTP head skipped."""
        for name, tensor in super().transform_checkpoint(weights):
            yield name.replace("model.language_model.", "model.", 1), tensor
