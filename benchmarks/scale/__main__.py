"""``python -m kvserve.benchmarks.scale``: GGUF made by llama.cpp's tools at 1-4B, served by kvserve
and llama-server (``make bench-scale``)."""

import sys

from kvserve.benchmarks.scale import main

sys.exit(main())
