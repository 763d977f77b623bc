"""``python -m kvserve.benchmarks.peers``: kvserve against vLLM and llama-server, served
(``compare``)."""

import sys

from kvserve.benchmarks.peers.compare import main

sys.exit(main())
