"""``python -m node_agent.inprocess PROGRAM [ARGS ...]``: run a wrapper that launches in-process
(``accelerate launch``, torchtune's ``tune run``) with node-agent in place of torchrun.

It calls :func:`node_agent.run.install` (``torch.distributed.run.run`` and ``main`` become
node-agent's, in this process only) and then runs PROGRAM's console script in this same
process, as its own command would: ``sys.argv`` is ``[PROGRAM, *ARGS]`` and its return value is
the exit status. PROGRAM is a console-script name of an installed package (``accelerate``,
``tune``), else a Python script on ``PATH`` or a path. Nothing outside this process changes.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    program, rest = argv[0], argv[1:]
    from importlib.metadata import entry_points

    from .run import install

    install()
    sys.argv = [program, *rest]
    found = entry_points(group="console_scripts", name=os.path.basename(program))
    for entry in found:
        result = entry.load()()
        return result if isinstance(result, int) else 0 if result is None else 1
    path = program if os.sep in program else shutil.which(program)
    if path is None or not os.path.isfile(path):
        print(f"node_agent.inprocess: {program!r} is neither a console script nor a file", file=sys.stderr)
        return 2
    import runpy

    sys.argv[0] = path
    runpy.run_path(path, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
