"""kvserve.engine.layers: the building blocks models are made of (linear, embedding and LM head,
norm, rotary, activation, MoE, quantized weights, attention/ backends) and the sampler. They
import ``kvserve.engine``'s vocabulary, ``distributed.parallel`` and the kernels; never the core,
the front-end or the executor.
"""
