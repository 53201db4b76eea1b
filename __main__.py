"""``python -m fewstep``: the command line (see ``fewstep.cli``)."""

import sys

from .cli import main

sys.exit(main())
