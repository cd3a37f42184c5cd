"""[main] ``python -m vlmserve``: the same as the ``vlmserve`` command."""

import sys

from vlmserve.cli import main

sys.exit(main())
