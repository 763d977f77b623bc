"""The data plane of one rank: ``model_runner`` (build the model, plan the KV cache, run a step's
forward and sample) and ``cuda_graphs`` (decode graphs on GPUs).
"""
