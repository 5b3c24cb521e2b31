"""``python -m node_agent.cli``: the ``node-agent`` command."""

import sys

from . import main

sys.exit(main())
