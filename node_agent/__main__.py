"""``python -m node_agent``: the ``node-agent`` command, for recipes that name the interpreter
(as ``python -m torch.distributed.run`` does for torchrun)."""

import sys

from .cli import main

sys.exit(main())
