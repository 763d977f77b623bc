"""Attention behind one interface (``backend``: ``AttentionBackend``, its metadata and the layer
that calls it), one file per backend: ``cpu_backend`` (the CPU's: torch ops and csrc/attention.c;
``--attention-backend torch``, also the reference elsewhere), ``triton_backend`` (GPUs without
flash-attn; tested on the CPU under TRITON_INTERPRET=1), ``flash_backend`` (flash-attn), and
``kv_quant`` (the int8 KV cache's rows).
"""
