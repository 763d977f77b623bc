"""``python -m kvserve.benchmarks.serving``: the serving benchmark (the same as ``kvserve bench``)."""

import sys

from kvserve.benchmarks.serving.bench import main

sys.exit(main())
