"""What tensor parallelism looks like from below: ``parallel`` (the rank/size a layer sees, how heads
are shared) and ``channels`` (the command channels to the workers: shared memory on one machine,
torch.distributed across machines). A leaf: it imports only ``kvserve.engine.config``.
"""
