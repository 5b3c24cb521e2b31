"""The pure parts are pure, as docs/architecture.md says: the wire (``protocol/``), the agent's
machine (``node_agent/machine/``) and the server's (``rdzv_server/machine/``), every module of
each folder, import only what an allow-list names, call no ``open``/``print``/``input``, and
reach into the rest of their program only for other pure modules (and a short list of pure
names from I/O modules). What reads files, the
environment, the clock or sockets lives at the programs' edge: ``edge/``, each program's
command line, the agent's runner and the server's service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What a pure module may import from outside the project, by folder: an allow-list, so a new
# dependency is a decision made here (``datetime``, ``uuid``, ``time``, ``socket``, ``asyncio``,
# ``aiohttp`` all fail). The standard library's pure parts, common to every pure folder:
ALLOWED = {
    "__future__",
    "bisect",
    "collections",
    "contextlib",
    "dataclasses",
    "enum",
    "functools",
    "hashlib",
    "heapq",
    "hmac",
    "ipaddress",
    "itertools",
    "math",
    "operator",
    "posixpath",  # path names only: nothing is opened
    "re",
    "statistics",
    "types",
    "typing",
    "typing_extensions",
}
# ... and, per folder, what only it needs. Every module of these folders is pure: the wire, and
# each program's machine (docs/architecture.md).
PURE_DIRS = {
    "protocol": {"msgpack", "ssl", "struct"},  # the frames' bytes; the TLS model's names
    "node_agent/machine": {"signal"},  # signal numbers and names
    "rdzv_server/machine": set(),
}
IO_CALLS = {"open", "input", "print"}

PURE_FILES = sorted(p for folder in PURE_DIRS for p in (ROOT / folder).glob("*.py"))


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


def _allowed(module: str) -> set[str]:
    folder = next(f for f in PURE_DIRS if module.startswith(f.replace("/", ".")))
    return ALLOWED | PURE_DIRS[folder]


def _faults(source: str, module: str, is_pkg: bool = False, where: str = "") -> list[str]:
    allowed = _allowed(module)
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
            found.append(f"{where}:{node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.Import):
            bad = [a.name for a in node.names if _bad(a.name, None, allowed)]
            found += [f"{where}:{node.lineno}: import {name}" for name in bad]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_pkg, node) if node.level else (node.module or "")
            for alias in node.names:
                if _bad(target, alias.name, allowed):
                    found.append(f"{where}:{node.lineno}: from {target} import {alias.name}")
    return found


def _bad(module: str, name: str | None, allowed: set[str]) -> bool:
    top = module.split(".")[0]
    if top not in PROJECT:
        return top not in allowed
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


def test_the_check_allows_only_what_it_lists() -> None:
    """An allow-list: modules no deny-list would name fail too, and one folder's extra (the
    agent's ``signal``) is not the server machine's; the machine's own modules and the wire pass."""
    source = (
        "import datetime\nimport uuid\nimport time\nimport socket\nimport asyncio\n"
        "from aiohttp import web\nimport signal\nfrom ..service import RendezvousService\n"
        "from . import history as said\nfrom .jobs import Job\nfrom protocol import Join\n"
        "import collections\n"
    )
    assert [f.split(": ", 1)[1] for f in _faults(source, "rdzv_server.machine.probe")] == [
        "import datetime",
        "import uuid",
        "import time",
        "import socket",
        "import asyncio",
        "from aiohttp import web",
        "import signal",
        "from rdzv_server.service import RendezvousService",
    ]
    assert _faults("import signal\n", "node_agent.machine.probe") == []


@pytest.mark.parametrize("folder", [f for f in PURE_DIRS if f.endswith("machine")])
def test_a_machine_package_is_empty(folder: str) -> None:
    """A machine's ``__init__.py`` holds a docstring at most: importing one module of the
    machine imports no other, and nothing is re-exported past the purity check."""
    body = ast.parse((ROOT / folder / "__init__.py").read_text()).body
    assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)
    assert len(body) <= 1
