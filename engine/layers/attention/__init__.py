"""Attention behind one interface (``backend``: ``AttentionBackend``, its metadata and the layer
that calls it), one file per backend: ``torch_backend`` (CPU and the reference), ``triton_backend``
(GPUs without flash-attn; tested on the CPU under TRITON_INTERPRET=1), ``flash_backend``
(flash-attn), and ``kv_quant`` (the int8 KV cache's rows).
"""
