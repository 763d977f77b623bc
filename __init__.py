"""kvserve: a compact LLM inference microservice.

The repository root is the ``kvserve`` package; its folders are installed as subpackages
(``kvserve.engine``, ``kvserve.service``, ...) so that no generic top-level name is claimed.
"""

import os

# OpenMP threads wait passively instead of spinning (engine/threads.py says why); the runtime
# reads this once, when torch loads it, so it is set before any kvserve module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
