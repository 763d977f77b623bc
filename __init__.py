"""kvserve: a compact LLM inference microservice.

The repository root is the ``kvserve`` package; its folders are installed as subpackages
(``kvserve.engine``, ``kvserve.service``, ...) so that no generic top-level name is claimed.
"""

__version__ = "0.1.0"
