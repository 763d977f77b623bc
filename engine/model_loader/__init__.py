"""Finding and reading models: ``loader`` (model directories, GGUF or safetensors weights, the
tokenizer, device and dtype), ``gguf_file`` (the GGUF reader) and ``generation_defaults`` (the
model's own sampling defaults). Models register themselves in ``kvserve.engine.models``; the
loader asks that registry and never imports a model module.
"""
