"""One surface for 1 or N tensor-parallel ranks: ``executor`` (rank 0 runs in the engine core and
drives the rest) and ``worker`` (the worker processes of ranks 1..N-1, started as
``kvserve worker``).
"""
