"""The model's tokenizer (with its chat template): from the GGUF file or the Hugging Face directory."""

from __future__ import annotations

from kvserve.engine.model_loader.source import ModelSource


def load_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if src.gguf_file:
        # the fast class directly: AutoTokenizer would first rebuild the config from the GGUF (seconds)
        return PreTrainedTokenizerFast.from_pretrained(src.path, gguf_file=src.gguf_file)
    return AutoTokenizer.from_pretrained(src.path)
