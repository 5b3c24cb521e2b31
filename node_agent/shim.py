"""``python -m node_agent.shim DIR``: a ``torchrun`` that is node-agent, in DIR, for wrappers
that start the ``torchrun`` command themselves (TorchX's ``dist.ddp`` and its other
torchrun-based components, shell recipes).

It writes one file, ``DIR/torchrun``: a script run by this interpreter that is the
``node-agent`` command (``node_agent.cli.main``: the same flags, exit codes and launcher error
file). Nothing else changes: torch's own ``torchrun`` stays where it is, and the shim takes
its place only for a process whose ``PATH`` has DIR first, which the user sets::

    python -m node_agent.shim ~/.node-agent/bin
    PATH=~/.node-agent/bin:$PATH torchx run -s local_cwd dist.ddp -j 1x2 --script train.py

Opt-in, and never silent: DIR must not hold another ``torchrun`` (torch's, in a virtual
environment's ``bin``, above all): an existing file that is not this shim is refused, one that
is is rewritten (a new interpreter path). Remove the file, or take DIR off ``PATH``, to undo.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["MARK", "main", "shim_text", "write_shim"]

NAME = "torchrun"
MARK = "# node-agent's torchrun shim (python -m node_agent.shim)"


def shim_text(python: str) -> str:
    """The shim: ``python`` runs ``node_agent.cli.main`` with the command line as given."""
    return (
        f"#!{python}\n"
        f"{MARK}: `torchrun ARGS` runs `node-agent ARGS`.\n"
        "# Remove this file, or take its folder off PATH, to have torch's torchrun again.\n"
        "import sys\n"
        "from node_agent.cli import main\n"
        "sys.exit(main())\n"
    )


def _is_shim(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return MARK in f.read(4096)
    except OSError:
        return False


def write_shim(folder: str, python: str | None = None) -> str:
    """Write ``folder/torchrun`` (the folder is made if missing); its path. Raises
    ``FileExistsError`` where another ``torchrun`` is there already."""
    folder = os.path.abspath(os.path.expanduser(folder))
    path = os.path.join(folder, NAME)
    if os.path.lexists(path) and not (os.path.isfile(path) and not os.path.islink(path) and _is_shim(path)):
        raise FileExistsError(
            f"{path} exists and is not node-agent's shim (torch's torchrun?): it is left alone; "
            "pick a folder of its own for the shim"
        )
    os.makedirs(folder, exist_ok=True)
    from edge.atomic_write import replace_file

    replace_file(path, shim_text(python or sys.executable), mode=0o755)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if args in (["-h"], ["--help"]) else 2
    try:
        path = write_shim(args[0])
    except (FileExistsError, OSError) as exc:
        print(f"node_agent.shim: {exc}", file=sys.stderr)
        return 1
    folder = os.path.dirname(path)
    print(f"wrote {path}: `torchrun` is node-agent where {folder} comes first on PATH:")
    print(f'    export PATH="{folder}:$PATH"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
