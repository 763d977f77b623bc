"""``python -m kvserve COMMAND``: the same as the ``kvserve`` command (see ``kvserve.cli``)."""

import sys

from kvserve.cli import main

sys.exit(main())
