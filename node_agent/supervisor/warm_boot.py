"""The warm interpreter's side (``--preload``): import modules, wait, then become a worker.

The agent runs this file with the workers' own Python and interpreter flags
(``python -u warm_boot.py CONFIG``), in the session, process group and environment a cold
worker of that local rank would get, less the values only a round decides (see ``warm.py``).
It imports the preloaded modules with ``sys.path[0]`` set as the cold start will set it, says
so on its control socket, and blocks there.  The handoff brings the worker's exact argv,
environment, working directory and its stdio descriptors (SCM_RIGHTS); this process then
becomes that worker: the descriptors go onto 0/1/2 and ``sys.std*`` are rebuilt as Python's
start-up builds them, every other descriptor is closed (the control socket included), and the
script, ``-m`` module or ``-c`` code runs as ``__main__`` the way ``python`` runs it.  An
uncaught exception is printed through ``sys.excepthook`` without this file's frames, and the
exit status (``SystemExit`` codes, the SIGINT death of an uncaught ``KeyboardInterrupt``) is a
cold start's.

Written for any Python 3.9+ the workers may use (``PYTHON_EXEC``), and self-contained: it
never imports node_agent, which that Python may not have.  Nothing here runs in the agent.

Wire format, both ways: a 4-byte big-endian length, then that much UTF-8 JSON; the handoff's
first bytes carry the descriptors.  Boot -> agent: ``{"ready": true}`` or
``{"ready": false, "error": TEXT}``; agent -> boot: ``{"argv", "env", "cwd", "targets"}``
(``targets``: the descriptor numbers 0/1/2 the passed descriptors go onto, in order);
boot -> agent: ``{"ok": true}`` or ``{"ok": false, "error": TEXT}``.
"""

import sys

# What Python put into __main__ for this (script) run, before anything of ours: the template of
# the worker's fresh __main__ (which keys exist and in what order depends on the version).
_INITIAL_MAIN_KEYS = tuple(globals())

import json  # noqa: E402  (after the snapshot above, on purpose)
import os  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the worker
if TYPE_CHECKING:
    from typing import Any

MAX_FRAME = 64 * 1024 * 1024  # the agent's handoff: an environment, however large, fits
MAX_FDS = 3
_BOOT_FILE = __file__


class BootError(Exception):
    """The handoff could not be applied; the agent starts the worker cold instead."""


def _send(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, fds: "list[int]") -> bytes:
    buf = bytearray()
    while len(buf) < n:
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        data, ancdata, _flags, _addr = sock.recvmsg(n - len(buf), space)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                count = len(payload) // 4
                fds.extend(struct.unpack(f"{count}i", payload[: count * 4]))
        if not data:
            raise BootError("the agent closed the control socket")
        buf += data
    return bytes(buf)


def _recv(sock: socket.socket) -> "tuple[dict[str, Any], list[int]]":
    fds: list[int] = []
    (length,) = struct.unpack(">I", _recv_exact(sock, 4, fds))
    if length > MAX_FRAME:
        raise BootError(f"handoff of {length} bytes is over {MAX_FRAME}")
    payload = json.loads(_recv_exact(sock, length, fds).decode("utf-8", "surrogatepass"))
    if not isinstance(payload, dict):
        raise BootError("handoff is not a JSON object")
    return payload, fds


def split_main(argv: "list[str]") -> "tuple[str, str, list[str]]":
    """``[python, *flags, ...]`` -> (kind, target, args): ("module", name, args),
    ("command", code, args) or ("script", path, args), as Python reads its command line."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c"):
            if i + 1 >= len(argv):
                raise BootError(f"{arg} without its argument")
            kind = "module" if arg == "-m" else "command"
            return kind, argv[i + 1], list(argv[i + 2 :])
        if arg == "--" or not arg.startswith("-") or arg == "-":
            j = i + 1 if arg == "--" else i
            if j >= len(argv) or argv[j] == "-":
                raise BootError("no script to run (stdin is not supported)")
            return "script", argv[j], list(argv[j + 1 :])
        i += 1
    raise BootError("no script, -m or -c in the command line")


def path0(kind: str, target: str) -> str:
    """What Python puts first on ``sys.path`` for this command line (without -P/safe_path)."""
    if kind == "module":
        return os.getcwd()
    if kind == "command":
        return ""
    return os.path.dirname(os.path.realpath(target))


def _set_path0(kind: str, target: str) -> None:
    if getattr(sys.flags, "safe_path", False):
        return  # -P / PYTHONSAFEPATH: Python inserts nothing, neither for us nor for a cold start
    if sys.path:
        sys.path[0] = path0(kind, target)
    else:
        sys.path.insert(0, path0(kind, target))


def _stdio(fd: int, name: str, template: "Any") -> "Any":
    """``sys.<name>`` for ``fd`` as Python's start-up (create_stdio) makes it, with the
    encoding, errors and buffering this interpreter chose at start-up (``template``)."""
    import io

    try:
        os.fstat(fd)
    except OSError:
        return None  # Python's start-up leaves sys.stdin etc. None for a closed descriptor
    write = fd != 0
    buffered = not getattr(template, "write_through", False)  # -u / PYTHONUNBUFFERED
    buffering = 0 if (write and not buffered) else -1
    buf: Any = open(fd, "wb" if write else "rb", buffering, closefd=False)
    raw = buf if buffering == 0 else buf.raw
    raw.name = f"<{name}>"
    isatty = raw.isatty()
    encoding = getattr(template, "encoding", None)
    errors = getattr(template, "errors", None)
    if name == "stderr":
        errors = "backslashreplace"
    stream: Any = io.TextIOWrapper(
        buf,
        encoding=encoding,
        errors=errors,
        newline="\n",
        line_buffering=buffered and (isatty or fd == 2),
        write_through=not buffered,
    )
    stream.mode = "w" if write else "r"
    return stream


def _become(payload: "dict[str, Any]", fds: "list[int]") -> "tuple[str, str, list[str], list[str]]":
    """Apply the handoff: cwd, environment, descriptors 0/1/2, sys.std*."""
    argv = payload["argv"]
    env = payload["env"]
    targets = payload["targets"]
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise BootError("argv is not a list of strings")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise BootError("env is not a map of strings")
    if sorted(targets) != sorted(set(targets)) or len(targets) != len(fds):
        raise BootError(f"targets {targets} do not match {len(fds)} descriptor(s)")
    kind, target, args = split_main(argv)
    os.chdir(payload["cwd"])
    templates = {0: sys.stdin or sys.stdout, 1: sys.stdout, 2: sys.stderr}
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    for i, target_fd in enumerate(targets):
        fd = fds[i]
        if target_fd not in (0, 1, 2):
            raise BootError(f"target descriptor {target_fd} is not 0, 1 or 2")
        os.dup2(fd, target_fd, inheritable=True)
    os.environ.clear()
    os.environ.update(env)
    names = {0: "stdin", 1: "stdout", 2: "stderr"}
    for fd in (0, 1, 2):
        stream = _stdio(fd, names[fd], templates[fd])
        setattr(sys, names[fd], stream)
        setattr(sys, f"__{names[fd]}__", stream)
    return kind, target, args, argv


def _close_other_fds() -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, already closed
                pass


def _fresh_main(kind: str, target: str) -> "tuple[object, dict[str, Any]]":
    import builtins
    import types

    machinery = sys.modules["_frozen_importlib"]
    external = sys.modules["_frozen_importlib_external"]
    module = types.ModuleType("__main__")
    d = module.__dict__
    d.clear()
    values = {
        "__name__": "__main__",
        "__doc__": None,
        "__package__": None,
        "__loader__": machinery.BuiltinImporter,
        "__spec__": None,
        "__annotations__": {},
        "__builtins__": builtins,
    }
    for key in _INITIAL_MAIN_KEYS:
        if key in values:
            d[key] = values[key]
    if kind == "script":
        path = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
        d["__loader__"] = external.SourceFileLoader("__main__", path)
        d["__file__"] = path
        d["__cached__"] = None
    sys.modules["__main__"] = module
    return module, d


def _run(kind: str, target: str, args: "list[str]") -> None:
    if kind == "module":
        import runpy

        sys.argv = ["-m", *args]
        _fresh_main(kind, target)
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # what python -m calls
        return
    sys.argv = [("-c" if kind == "command" else target), *args]
    _module, d = _fresh_main(kind, target)
    if kind == "command":
        code = compile(target, "<string>", "exec", dont_inherit=True)
        exec(code, d)
        return
    path = d["__file__"]
    try:
        with open(path, "rb") as f:
            source = f.read()
        code = compile(source, path, "exec", dont_inherit=True)
        exec(code, d)
    finally:
        # What python does once the script is done, whatever the outcome.
        d.pop("__file__", None)
        d.pop("__cached__", None)


def _strip(tb: object) -> object:
    while tb is not None and tb.tb_frame.f_code.co_filename == _BOOT_FILE:  # type: ignore[attr-defined]
        tb = tb.tb_next  # type: ignore[attr-defined]
    return tb


def _exit_by_sigint() -> None:
    """What python does after an uncaught KeyboardInterrupt: finish as usual (threads, atexit,
    flush), then die of SIGINT so that the parent sees the signal."""
    import atexit
    import signal

    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # SIGINT blocked: python returns the same code


def _uncaught(exc: BaseException) -> None:
    """Print an uncaught exception as python does, without this file's frames, and exit 1 (or
    by SIGINT); SystemExit never gets here."""
    tb = _strip(exc.__traceback__)
    exc.__traceback__ = tb  # type: ignore[assignment]
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb  # type: ignore[assignment]
    if sys.version_info >= (3, 12):
        sys.last_exc = exc  # type: ignore[attr-defined,unused-ignore]
    try:
        sys.excepthook(type(exc), exc, tb)  # type: ignore[arg-type]
    except BaseException as hook_error:  # python's own words for a failing hook
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, _strip(hook_error.__traceback__))  # type: ignore[arg-type]
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)  # type: ignore[arg-type]
    if isinstance(exc, KeyboardInterrupt):
        _exit_by_sigint()
    raise SystemExit(1)


def _restore_signals(ignored: "list[int]") -> None:
    """A cold worker's dispositions. The agent started this interpreter with the signals a
    scheduler sends to every process of a job step ignored (``ignored``), so that it outlives
    them while it waits; a cold worker has them at their defaults (Python's own SIGINT handler
    included). One a preloaded module set to something else stays as it set it."""
    if not ignored:
        return
    import signal

    for signum in ignored:
        if signal.getsignal(signum) == signal.SIG_IGN:
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)


def _ignore_signals(ignored: "list[int]") -> None:
    """Ignore the step's signals as this process's first act: the agent's preexec_fn ignored
    them already, but libuv (uvloop, the agent's loop) resets every disposition after it."""
    if ignored:
        import signal

        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)


def main() -> None:
    config = json.loads(sys.argv[1])
    if config.get("idle"):
        # A refill warms on cores the workers leave free; the agent puts every thread of it
        # back to SCHED_OTHER before a worker takes it (warm.py).
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
    _ignore_signals(config.get("ignored", []))
    sock = socket.socket(fileno=int(config["fd"]))
    kind, target, _args = split_main(config["argv"])
    error = None
    try:
        _set_path0(kind, target)
        if kind == "script" and not os.path.isfile(target):
            raise BootError(f"{target!r} is not a regular file (zip and directory scripts start cold)")
        for name in config["preload"]:
            __import__(name)
    except BaseException as exc:  # SystemExit or KeyboardInterrupt from a module count too
        import traceback

        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    _send(sock, {"ready": error is None, "error": error})
    if error is not None:
        sys.exit(3)
    try:
        payload, fds = _recv(sock)
        kind, target, args, argv = _become(payload, fds)
        if kind == "script" and not os.path.isfile(target):
            raise BootError(f"{target!r} is not a regular file")
    except (BootError, OSError, KeyError, ValueError, TypeError) as exc:
        try:
            _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        os._exit(3)
    _send(sock, {"ok": True})
    sock.close()
    _close_other_fds()
    # What a cold worker would have: the defaults, but what the agent ignores stays ignored.
    keep = payload.get("ignored", [])
    _restore_signals([s for s in config.get("ignored", []) if s not in keep])
    if hasattr(sys, "orig_argv"):
        sys.orig_argv = list(argv)
    _set_path0(kind, target)
    try:
        _run(kind, target, args)
    except SystemExit:
        raise  # python itself turns it into the exit status, printing nothing of ours
    except BaseException as exc:
        _uncaught(exc)


if __name__ == "__main__":
    main()
