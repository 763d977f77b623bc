"""Finding and reading models: ``source`` (where a model lives; torch-free, the front-end asks it),
``loader`` (config, stop tokens, weights from GGUF or safetensors, device and dtype), ``gguf_file``
(the GGUF reader), ``weights`` (checkpoint names routed to parameters), ``checkpoint`` (a model's
checkpoint names and shapes, and seeded random weights) and ``generation_defaults`` (the model's
own sampling defaults). The models register themselves in ``kvserve.engine.models``; the loader
asks that registry, and no model imports the loader.
"""
