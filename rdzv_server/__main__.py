"""``python -m rdzv_server``: the ``rdzv-server`` command, with the interpreter named."""

import sys

from .cli import main

sys.exit(main())
