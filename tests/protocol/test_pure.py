"""protocol/ is pure, as docs/architecture.md says: it imports nothing that does I/O and
opens no file. What reads files, the environment or sockets lives at the programs' edge
(``edge/``, each program's command line and service)."""

from __future__ import annotations

import ast
from pathlib import Path

import protocol

IO_MODULES = {
    "asyncio",
    "io",
    "os",
    "pathlib",
    "selectors",
    "shutil",
    "socket",
    "subprocess",
    "sys",
    "tempfile",
}
IO_CALLS = {"open", "input", "print"}


def test_the_protocol_package_does_no_io() -> None:
    found = []
    for path in sorted(Path(protocol.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
                found.append(f"{path.name}:{node.lineno}: {node.func.id}()")
                continue
            else:
                continue
            found += [
                f"{path.name}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in IO_MODULES
            ]
    assert found == []
