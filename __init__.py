"""kvserve: a compact LLM inference microservice.

The repository root is the ``kvserve`` package; its folders are installed as subpackages
(``kvserve.engine``, ``kvserve.service``, ...) so that no generic top-level name is claimed.
"""

import os

# OpenMP threads spin 30,000 rounds before they sleep, a tenth of libgomp's default 300,000
# (engine/process/threads.py says why); the runtime reads this once, when torch loads it,
# so it is set before any kvserve module imports torch. A wait policy the user chose
# (OMP_WAIT_POLICY, GOMP_SPINCOUNT) is left as it is.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.1.0"
