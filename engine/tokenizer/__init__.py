"""Text <-> token ids: the model's tokenizer (``load``), prompts and chat templates (``prompts``)
and the incremental detokenizer with stop strings (``detokenizer``). Used by the in-process engine
and by the front-end alike.
"""
