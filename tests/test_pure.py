"""The pure parts are pure, as docs/architecture.md says: the wire (``protocol/``), the agent's
machine (``node_agent/machine/``) and the server's machine modules import nothing that does
I/O, call no ``open``/``print``/``input``, and reach into the rest of their program only for
other pure modules (and a short list of pure names from I/O modules). What reads files, the
environment, the clock or sockets lives at the programs' edge: ``edge/``, each program's
command line, the agent's runner and the server's service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
    "time",
    "threading",
    "logging",
    "random",
}
IO_CALLS = {"open", "input", "print"}

# The server's machine: state.py and the layers under it (docs/architecture.md, "the machine").
SERVER_MACHINE = (
    "state",
    "recovery",
    "rounds",
    "restore_rules",
    "restore_points",
    "provenance",
    "commits",
    "training_rules",
    "jobs",
    "history",
    "progress",
    "events",
    "hang_cause",
    "faults",
    "addresses",
)
PURE_FILES = sorted(
    [*(ROOT / "protocol").glob("*.py"), *(ROOT / "node_agent" / "machine").glob("*.py")]
    + [ROOT / "rdzv_server" / f"{name}.py" for name in SERVER_MACHINE]
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PURE_MODULES = {_module(p) for p in PURE_FILES} | {"protocol", "node_agent.worker.layout"}
# Pure functions that live in an I/O module, named one by one.
# shown: an escape for text a peer sent; AgentConfig: the frozen config, only read.
PURE_NAMES = {("node_agent.agent_log", "shown"), ("node_agent.config", "AgentConfig")}
PROJECT = ("protocol", "edge", "node_agent", "rdzv_server")


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _faults(source: str, module: str, is_pkg: bool = False, where: str = "") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
            found.append(f"{where}:{node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if _bad(a.name, None)]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_pkg, node) if node.level else (node.module or "")
            for alias in node.names:
                if _bad(target, alias.name):
                    found.append(f"{where}:{node.lineno}: from {target} import {alias.name}")
    return found


def _bad(module: str, name: str | None) -> bool:
    top = module.split(".")[0]
    if top in IO_MODULES:
        return True
    if top not in PROJECT:
        return False
    if name is not None and (f"{module}.{name}" in PURE_MODULES or (module, name) in PURE_NAMES):
        return False
    return module not in PURE_MODULES


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_does_no_io(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    assert _faults(path.read_text(), _module(path), path.name == "__init__.py", where) == []


def test_the_check_finds_io() -> None:
    """The check itself: an I/O import, an I/O module of ours and open() are each found."""
    source = "import os\nfrom ..runner import Agent\nfrom .events import Exit\nopen('x')\n"
    assert [f.split(": ", 1)[1] for f in _faults(source, "node_agent.machine.probe")] == [
        "import os",
        "from node_agent.runner import Agent",
        "open()",
    ]
