"""Sharded state (FSDP2, DTensor) in the rank's in-memory snapshot, through torch.distributed.checkpoint.

    from node_agent.worker import dcp_snapshots

    def state():
        model_sd, optim_sd = get_state_dict(model, opt)  # FSDP2: DTensors
        return {"model": model_sd, "optim": optim_sd}

    sd = state()
    step = dcp_snapshots.load(sd)                   # filled into sd; None: nothing to restore
    if step is not None:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for step in range(step + 1 if step is not None else 0, steps):
        train_step()
        if step % 100 == 0:
            dcp_snapshots.save(step, state())       # a collective, like dcp.save

Both are collectives: every rank of ``process_group`` calls them. ``save`` runs DCP's planning
(``dcp.save`` with a planner and a storage writer of ours) and writes this rank's shards, and
everything it needs to load them back, into ``worker.snapshot(step)``: one file per rank per
step, as a plain snapshot, inside ``worker.phase("snapshot")`` (the server counts it as
checkpoint time). ``load`` reads the file ``worker.restore()`` gives back (``dcp.load`` with a
storage reader of ours over a map of the file) into the tensors and DTensors of ``state_dict``.

Why each rank's file stands alone: a restarted rank reads only its own node's memory, so every
rank stores its own copy of DCP's global metadata (``dcp.save`` hands it to every rank) and of
every item it holds, replicated ones included (DCP writes a replicated tensor once, on one rank;
here each rank keeps its own copy, so each restores exactly what it saved).

The file is ours: a 64-byte header (magic, version, lengths), the raw little-endian bytes of each
tensor and the ``torch.save`` bytes of each non-tensor item, then a JSON document (DCP's metadata,
the world size, this rank's index of offsets and lengths). Nothing read from it is unpickled
beyond ``torch.load(weights_only=True)`` of the non-tensor items (the file may be a peer's
replica); every length, count and offset is checked before use: a damaged file raises
:class:`SnapshotFormatError`.

The server chooses a restore step only at the world size of the snapshots, so a job that
changes size gets None from ``restore()`` and resumes from its durable checkpoint; a file of
another world size met anyway raises :class:`WorldSizeMismatch`.

torch is imported inside the functions only: importing this module costs what
``node_agent.worker.snapshots`` costs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from . import _MAX_STEP, _as_step, phase
from .snapshots import SnapshotCorrupt, restore, snapshot

__all__ = ["RestoreFailed", "SnapshotFormatError", "WorldSizeMismatch", "load", "save"]

MAGIC = b"NADCPSN\x00"
VERSION = 1
# magic, version, flags (0), length of the data region, length of the JSON metadata; padded to 64.
HEADER = struct.Struct("<8sIIQQ32x")
HEADER_SIZE = HEADER.size
ALIGN = 64  # every item starts at a multiple of it: a tensor's bytes are viewed in place
MAX_METADATA = 256 << 20  # bytes of JSON a file may declare
MAX_DIMS = 64
MAX_PATH = 1024  # keys in one planner_data path (the nesting of a state dict)
_MAX_INT = (1 << 63) - 1
_MAX_TEXT = 500  # characters of another rank's error repeated in ours
# torch dtypes a snapshot holds, by the name after "torch." (the JSON's "dtype").
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
_METADATA_KEYS = {"world_size", "rank", "step", "tensors", "bytes", "planner_data", "items"}


class SnapshotFormatError(SnapshotCorrupt):
    """This rank's snapshot file is not a complete ``dcp_snapshots.save`` file (truncated,
    damaged or made by something else): nothing is loaded from it."""


class WorldSizeMismatch(RuntimeError):
    """The snapshot was saved at another world size: its shards are not this rank's."""


class RestoreFailed(RuntimeError):
    """The ranks cannot all restore the same step (one has nothing, or could not read its
    file): every rank raises, since ranks resuming from different states would diverge."""


def save(step: int, state_dict: dict[str, Any], *, process_group: Any = None) -> None:
    """Snapshot ``state_dict`` (tensors, DTensors, Stateful objects, plain values) as this
    rank's state at ``step``: a collective, every rank of ``process_group`` calls it.

    Each rank's file holds its own shards and DCP's global metadata, so that it loads back at
    the same world size from that file alone. Outside node-agent the bytes are made and
    discarded (the cost of the serialisation), as ``worker.snapshot`` does."""
    if type(step) is not int or not 0 <= step <= _MAX_STEP:
        step = _as_step(step, "dcp_snapshots.save")
    _check_byte_order()
    kit = _kit()
    dist = kit.dist
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if on else (0, 1)
    with phase("snapshot"), contextlib.ExitStack() as stack:
        # The file is opened inside DCP's write step, where a rank's error reaches every rank
        # (one failing alone before a collective would leave the others waiting in it).
        writer = kit.Writer(lambda: stack.enter_context(snapshot(step)))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                metadata = kit.dcp.save(
                    state_dict,
                    storage_writer=writer,
                    planner=kit.SavePlanner(),
                    process_group=process_group,
                    no_dist=not on,
                )
        except kit.CheckpointException as exc:
            raise _own_error(exc, writer.error, rank) from exc
        f = writer.file()  # opened in DCP's write step
        end = f.tell()
        doc = encode_metadata(metadata, writer.items, step=step, rank=rank, world_size=world)
        f.write(doc)
        f.seek(0)
        f.write(HEADER.pack(MAGIC, VERSION, 0, end - HEADER_SIZE, len(doc)))


def load(
    state_dict: dict[str, Any], *, process_group: Any = None, safe_globals: Sequence[Any] = ()
) -> int | None:
    """Load the snapshot of the step the job restores from into ``state_dict``, in place (DCP's
    semantics: its tensors and DTensors are filled, its other values replaced), and return the
    step; None when there is nothing to restore (``state_dict`` is then untouched). A
    collective: every rank of ``process_group`` calls it.

    The ranks first agree: if one has nothing to restore and another has, or one cannot read
    its file, every rank raises :class:`RestoreFailed` (that rank its own error), never a
    silent divergence. A file of another world size raises :class:`WorldSizeMismatch` (in
    practice the server picks no restore step then: the job resumes from its durable
    checkpoint). Non-tensor items are unpickled with ``weights_only=True``; ``safe_globals``
    names the classes they may hold beside torch's own (``UnsafeSnapshot`` otherwise)."""
    kit = _kit()
    dist = kit.dist
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if on else (0, 1)
    reader: Any = None
    local: tuple[str, int, str]
    failure: BaseException | None = None
    try:  # everything that may fail on one rank alone, before the first collective
        r = restore()
        if r is not None:
            _check_byte_order()
            parsed = parse(r.path)
            _check_parsed(parsed, r.path, r.step, rank, world)
            reader = kit.Reader(parsed)
        local = ("ok", reader.parsed.step, "") if reader is not None else ("none", -1, "")
    except Exception as exc:
        failure = exc
        local = ("error", -1, f"{type(exc).__name__}: {exc}"[:_MAX_TEXT])
    try:
        views = [local]
        if on:
            views = [("error", -1, "")] * world
            dist.all_gather_object(views, local, group=process_group)
        _agree(views, rank, failure)
        if reader is None:
            return None
        _load(kit, reader, state_dict, process_group, on, rank, list(safe_globals))
        step: int = reader.parsed.step
        return step
    finally:
        if reader is not None:
            reader.close()


def _load(
    kit: Any,
    reader: Any,
    state_dict: dict[str, Any],
    process_group: Any,
    on: bool,
    rank: int,
    safe: list[Any],
) -> None:
    """``dcp.load`` through ``reader``; this rank's own error raised as itself, another
    rank's as :class:`RestoreFailed`."""
    parsed = reader.parsed
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            kit.dcp.load(
                state_dict,
                storage_reader=reader,
                planner=kit.LoadPlanner(safe),
                process_group=process_group,
                no_dist=not on,
            )
    except kit.CheckpointException as exc:
        own = _own_error(exc, reader.error, rank)
        if own is exc:
            failures: dict[int, Any] = getattr(exc, "failures", {})
            failed = ", ".join(map(str, sorted(failures))) or "?"
            first = next(iter(failures.values()), (exc,))[0]
            raise RestoreFailed(
                f"rank {failed} could not load the snapshot of step {parsed.step} ({type(first).__name__}: "
                f"{str(first)[:_MAX_TEXT]}); every rank raises, since ranks resuming from different "
                "states would diverge"
            ) from exc
        raise own from exc


def _own_error(exc: Any, recorded: BaseException | None, rank: int) -> BaseException:
    """The error this rank raised inside DCP's collective step (DCP hands every rank a
    ``CheckpointException``, a ``BaseException`` listing each failed rank's), or ``exc`` itself
    when this rank did not fail."""
    if recorded is not None:
        return recorded
    mine = exc.failures.get(rank)
    return mine[0] if mine is not None and isinstance(mine[0], Exception) else exc


def _agree(views: Sequence[tuple[str, int, str]], rank: int, failure: BaseException | None) -> None:
    """Raise on every rank unless all have the same step or all have nothing to restore."""
    errors = [(i, text) for i, (kind, _, text) in enumerate(views) if kind == "error"]
    if errors:
        if failure is not None:
            raise failure
        i, text = errors[0]
        raise RestoreFailed(
            f"rank {i} cannot restore its snapshot ({text}); no rank loads, since ranks resuming "
            "from different states would diverge"
        )
    steps = {step for kind, step, _ in views if kind == "ok"}
    empty = [i for i, (kind, _, _) in enumerate(views) if kind == "none"]
    if steps and empty:
        have = [i for i, (kind, _, _) in enumerate(views) if kind == "ok"]
        raise RestoreFailed(
            f"ranks {_ranks(have)} restore step {min(steps)} and ranks {_ranks(empty)} have nothing "
            f"to restore (this is rank {rank}); starting some ranks afresh while others resume "
            "would make them diverge"
        )
    if len(steps) > 1:
        raise RestoreFailed(f"the ranks restore different steps ({sorted(steps)}): not loaded")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _check_parsed(p: Parsed, path: str, step: int, rank: int, world: int) -> None:
    if p.world_size != world:
        raise WorldSizeMismatch(
            f"the snapshot of step {step} ({path}) was saved by a world of {p.world_size} ranks and "
            f"this world has {world}: DCP snapshots load back only at the world size they were "
            "saved at (the server restores one only then); resume from the durable checkpoint"
        )
    if p.step != step:
        raise SnapshotFormatError(f"{path}: the file holds step {p.step}, not the restore step {step}")
    if p.rank != rank:
        raise SnapshotFormatError(f"{path}: the file was saved by rank {p.rank}, and this is rank {rank}")


def _check_byte_order() -> None:
    if sys.byteorder != "little":  # the tensors' bytes are written as they are in memory
        raise RuntimeError("dcp_snapshots stores tensors little-endian: this machine is big-endian")


# ---------------------------------------------------------------------------------------------
# The file format


class Parsed:
    """A checked snapshot file: DCP's ``Metadata`` rebuilt, this rank's index into the data
    region (``(fqn, offsets or None) -> (start, length, sizes or None)``), the header's facts."""

    __slots__ = ("data_end", "index", "metadata", "path", "rank", "step", "world_size")

    def __init__(
        self,
        path: str,
        metadata: Any,
        index: dict[tuple[str, tuple[int, ...] | None], tuple[int, int, tuple[int, ...] | None]],
        step: int,
        rank: int,
        world_size: int,
        data_end: int,
    ) -> None:
        self.path, self.metadata, self.index = path, metadata, index
        self.step, self.rank, self.world_size, self.data_end = step, rank, world_size, data_end


def encode_metadata(
    metadata: Any,
    items: Sequence[tuple[str, Sequence[int] | None, Sequence[int] | None, int, int]],
    *,
    step: int,
    rank: int,
    world_size: int,
) -> bytes:
    """The JSON that ends a snapshot file: DCP's ``Metadata`` (its tensors' dtypes, sizes and
    chunks, its non-tensor items, the planner's key paths) and this rank's items as
    ``(fqn, offsets, sizes, start, length)`` (offsets and sizes None for a non-tensor item)."""
    kit = _kit()
    tensors: dict[str, Any] = {}
    byte_items: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, kit.TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": _dtype_name(md.properties.dtype),
                "requires_grad": bool(md.properties.requires_grad),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            byte_items.append(fqn)
    planner_data = metadata.planner_data
    doc = {
        "world_size": world_size,
        "rank": rank,
        "step": step,
        "tensors": tensors,
        "bytes": byte_items,
        "planner_data": (
            {k: list(v) for k, v in planner_data.items()} if isinstance(planner_data, dict) else None
        ),
        "items": [
            {
                "fqn": fqn,
                "offsets": None if offsets is None else list(offsets),
                "sizes": None if sizes is None else list(sizes),
                "at": at,
                "nbytes": n,
            }
            for fqn, offsets, sizes, at, n in items
        ],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def parse(path: str) -> Parsed:
    """Read and check the header and metadata of the snapshot file at ``path``: every length,
    count, offset and type, before anything is allocated by them or mapped."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise _bad(path, f"{size} bytes, shorter than the {HEADER_SIZE}-byte header")
        magic, version, flags, data_length, meta_length = HEADER.unpack(head)
        if magic != MAGIC:
            raise _bad(path, f"no dcp_snapshots header (magic {magic!r}): not a dcp_snapshots.save file")
        if version != VERSION:
            raise _bad(path, f"format version {version}; this code reads version {VERSION}")
        if flags:
            raise _bad(path, f"unknown flags {flags:#x}")
        if meta_length > MAX_METADATA:
            raise _bad(
                path, f"declares {meta_length} bytes of metadata, more than the {MAX_METADATA} allowed"
            )
        if HEADER_SIZE + data_length + meta_length != size:
            raise _bad(
                path,
                f"the header declares {HEADER_SIZE} + {data_length} + {meta_length} bytes and the file "
                f"has {size} (truncated or damaged)",
            )
        f.seek(HEADER_SIZE + data_length)
        raw = f.read(meta_length)
    if len(raw) != meta_length:
        raise _bad(path, "the file shrank while being read")
    return _parse_metadata(path, raw, HEADER_SIZE + data_length)


def _parse_metadata(path: str, raw: bytes, data_end: int) -> Parsed:
    kit = _kit()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(path, f"the metadata is not JSON ({type(exc).__name__})") from None
    c = _Checker(path)
    c.keys(doc, _METADATA_KEYS, "the metadata")
    world = c.num(doc["world_size"], "world_size", 1, 1 << 31)
    rank = c.num(doc["rank"], "rank", 0, world - 1)
    step = c.num(doc["step"], "step", 0, _MAX_STEP)

    dtypes = _dtypes()
    md: dict[str, Any] = {}
    chunk_sets: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    tensor_dtypes: dict[str, Any] = {}
    for fqn, t in c.obj(doc["tensors"], "tensors").items():
        c.keys(t, {"dtype", "requires_grad", "size", "chunks"}, f"tensor {fqn!r}")
        dtype = dtypes.get(t["dtype"]) if isinstance(t["dtype"], str) else None
        if dtype is None:
            raise _bad(path, f"tensor {fqn!r} has an unknown dtype {str(t['dtype'])[:40]!r}")
        if type(t["requires_grad"]) is not bool:
            raise _bad(path, f"tensor {fqn!r}: requires_grad is not a bool")
        size = c.dims(t["size"], f"the size of {fqn!r}")
        chunks = []
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for chunk in c.seq(t["chunks"], f"the chunks of {fqn!r}"):
            c.keys(chunk, {"offsets", "sizes"}, f"a chunk of {fqn!r}")
            offsets = c.dims(chunk["offsets"], f"a chunk's offsets of {fqn!r}", len(size))
            sizes = c.dims(chunk["sizes"], f"a chunk's sizes of {fqn!r}", len(size))
            if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
                raise _bad(path, f"a chunk of {fqn!r} ({offsets} + {sizes}) lies outside its size {size}")
            seen.add((offsets, sizes))
            chunks.append(kit.ChunkStorageMetadata(offsets=kit.Size(offsets), sizes=kit.Size(sizes)))
        props = kit.TensorProperties(dtype=dtype, requires_grad=t["requires_grad"])
        md[fqn] = kit.TensorStorageMetadata(properties=props, size=kit.Size(size), chunks=chunks)
        chunk_sets[fqn] = seen
        tensor_dtypes[fqn] = dtype
    for fqn in c.seq(doc["bytes"], "bytes"):
        if not isinstance(fqn, str) or fqn in md:
            raise _bad(path, f"a non-tensor item's name is not a new string: {str(fqn)[:80]!r}")
        md[fqn] = kit.BytesStorageMetadata()

    planner_data: dict[str, tuple[str | int, ...]] | None = None
    if doc["planner_data"] is not None:
        planner_data = {}
        for fqn, keys in c.obj(doc["planner_data"], "planner_data").items():
            keys = c.seq(keys, f"the key path of {fqn!r}")
            if len(keys) > MAX_PATH or not all(
                isinstance(k, str) or (type(k) is int and 0 <= k <= _MAX_INT) for k in keys
            ):
                raise _bad(path, f"the key path of {fqn!r} is not a list of names and indices")
            planner_data[fqn] = tuple(keys)

    index: dict[tuple[str, tuple[int, ...] | None], tuple[int, int, tuple[int, ...] | None]] = {}
    for item in c.seq(doc["items"], "items"):
        c.keys(item, {"fqn", "offsets", "sizes", "at", "nbytes"}, "an item")
        fqn = item["fqn"]
        if not isinstance(fqn, str) or fqn not in md:
            raise _bad(path, f"an item names {str(fqn)[:80]!r}, which the metadata does not hold")
        at = c.num(item["at"], f"the start of {fqn!r}", HEADER_SIZE, data_end)
        nbytes = c.num(item["nbytes"], f"the length of {fqn!r}", 0, data_end - at)
        if at % ALIGN:
            raise _bad(path, f"the item {fqn!r} starts at {at}, not a multiple of {ALIGN}")
        if fqn in chunk_sets:
            offsets = c.dims(item["offsets"], f"the offsets of {fqn!r}", len(md[fqn].size))
            sizes = c.dims(item["sizes"], f"the sizes of {fqn!r}", len(md[fqn].size))
            if (offsets, sizes) not in chunk_sets[fqn]:
                raise _bad(path, f"the item {fqn!r} at {offsets} ({sizes}) is no chunk of the metadata")
            numel = 1
            for s in sizes:
                numel *= s
            if numel * tensor_dtypes[fqn].itemsize != nbytes:
                raise _bad(path, f"the item {fqn!r} at {offsets} has {nbytes} bytes for {sizes} elements")
            key: tuple[str, tuple[int, ...] | None] = (fqn, offsets)
            entry: tuple[int, int, tuple[int, ...] | None] = (at, nbytes, sizes)
        else:
            if item["offsets"] is not None or item["sizes"] is not None:
                raise _bad(path, f"the non-tensor item {fqn!r} has offsets or sizes")
            key, entry = (fqn, None), (at, nbytes, None)
        if key in index:
            raise _bad(path, f"the item {fqn!r} at {key[1]} is listed twice")
        index[key] = entry
    metadata = kit.Metadata(state_dict_metadata=md, planner_data=planner_data)
    return Parsed(path, metadata, index, step, rank, world, data_end)


class _Checker:
    """Type and range checks of the JSON's values, each failure a :class:`SnapshotFormatError`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def keys(self, value: object, keys: set[str], what: str) -> None:
        if not isinstance(value, dict) or set(value) != keys:
            raise _bad(self.path, f"{what} is not an object with the keys {sorted(keys)}")

    def obj(self, value: object, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _bad(self.path, f"{what} is not an object")
        return value

    def seq(self, value: object, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise _bad(self.path, f"{what} is not a list")
        return value

    def num(self, value: object, what: str, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise _bad(self.path, f"{what} is not an integer in {lo}..{hi}: {str(value)[:40]}")
        return value

    def dims(self, value: object, what: str, ndim: int | None = None) -> tuple[int, ...]:
        items = self.seq(value, what)
        if len(items) > MAX_DIMS or (ndim is not None and len(items) != ndim):
            want = f"{ndim}" if ndim is not None else f"at most {MAX_DIMS}"
            raise _bad(self.path, f"{what} has {len(items)} dimensions, not {want}")
        return tuple(self.num(v, what, 0, _MAX_INT) for v in items)


def _bad(path: str, why: str) -> SnapshotFormatError:
    return SnapshotFormatError(f"{path} is not a readable dcp_snapshots file: {why}; nothing was loaded")


def _dtypes() -> dict[str, Any]:
    dtypes: dict[str, Any] = _kit().dtypes
    return dtypes


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _dtypes():
        raise TypeError(f"dcp_snapshots cannot store a tensor of {dtype} (it stores {', '.join(_dtypes())})")
    return name


# ---------------------------------------------------------------------------------------------
# torch's side: made at the first call (torch imported then), kept for the process.

_KIT: Any = None


def _kit() -> Any:
    global _KIT
    if _KIT is None:
        _KIT = _make_kit()
    return _KIT


def _make_kit() -> Any:
    # By name: the type checker stays out of torch (minutes of analysis for a few calls).
    torch = importlib.import_module("torch")
    dcp = importlib.import_module("torch.distributed.checkpoint")
    meta = importlib.import_module("torch.distributed.checkpoint.metadata")
    planner_mod = importlib.import_module("torch.distributed.checkpoint.planner")
    storage = importlib.import_module("torch.distributed.checkpoint.storage")
    default = importlib.import_module("torch.distributed.checkpoint.default_planner")
    WriteItemType, LoadItemType = planner_mod.WriteItemType, planner_mod.LoadItemType
    # Any-typed names: the type checker sees classes of ours on bases it does not analyse.
    save_base: Any = default.DefaultSavePlanner
    load_base: Any = default.DefaultLoadPlanner
    writer_base: Any = storage.StorageWriter
    reader_base: Any = storage.StorageReader

    class SavePlanner(save_base):
        """DCP's default planner, except that every rank writes every item it holds: the
        metadata is DCP's (replicated items listed once), the plans each rank's own, so that
        each rank's file has all it needs to load without another rank's file."""

        def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
            _same_replicas(all_plans)
            _, metadata = super().create_global_plan(all_plans)
            self.global_plan = all_plans
            return all_plans, metadata

    class LoadPlanner(load_base):
        """DCP's default load planner, but non-tensor items are unpickled with
        ``weights_only=True`` (DCP's own loads them with ``weights_only=False``)."""

        def __init__(self, safe_globals: list[Any]) -> None:
            super().__init__()
            self._safe_globals = safe_globals

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = _safe_torch_load(torch, value, self._safe_globals, fqn)
            if self.flatten_state_dict:
                _set_path(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class Writer(writer_base):
        """Writes each item of this rank's plan into the snapshot file, aligned, and records
        where: ``items`` as ``(fqn, offsets, sizes, start, length)``."""

        def __init__(self, open_file: Callable[[], Any]) -> None:
            super().__init__()
            self._open_file = open_file
            self.out: Any = None
            self.error: Exception | None = None
            self.items: list[tuple[str, tuple[int, ...] | None, tuple[int, ...] | None, int, int]] = []

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                results = self._write(plan, planner)
            except Exception as exc:
                raise self._stand_in(exc) from exc
            fut = torch.futures.Future()
            fut.set_result(results)
            return fut

        def _stand_in(self, exc: Exception) -> Exception:
            # DCP pickles a rank's error to the coordinator: one that does not unpickle
            # (SnapshotTooLarge) makes the coordinator fail with a TypeError and skip the
            # broadcast the other ranks wait in. A plain stand-in goes; this rank raises its own.
            self.error = exc
            return RuntimeError(f"{type(exc).__name__}: {exc}")

        def file(self) -> Any:
            """The snapshot file, opened at the first call, the header's place reserved."""
            if self.out is None:
                self.out = self._open_file()
                self.out.write(bytes(HEADER_SIZE))  # written again once the lengths are known
            return self.out

        def _write(self, plan: Any, planner: Any) -> list[Any]:
            self.file()
            results = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    offsets: tuple[int, ...] | None = None
                    sizes: tuple[int, ...] | None = None
                    at, n = self._put(data.getbuffer())
                else:
                    t = data.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    t = t.contiguous()
                    _dtype_name(t.dtype)
                    offsets, sizes = tuple(item.index.offset), tuple(t.shape)
                    if sizes != tuple(item.tensor_data.chunk.sizes):
                        raise RuntimeError(
                            f"{item.index.fqn}: the planned chunk and the tensor differ in shape"
                        )
                    at, n = self._put(_raw(t))
                self.items.append((item.index.fqn, offsets, sizes, at, n))
                results.append(storage.WriteResult(index=item.index, size_in_bytes=n, storage_data=None))
            return results

        def _put(self, data: memoryview) -> tuple[int, int]:
            pad = -self.out.tell() % ALIGN
            if pad:
                self.out.write(bytes(pad))
            at = self.out.tell()
            if data.nbytes:
                self.out.write(data)
            return at, data.nbytes

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            pass  # the metadata comes back from dcp.save on every rank; each writes it

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    class Reader(reader_base):
        """Reads this rank's items out of a map of its snapshot file, copying each straight
        into the tensor the planner names (the one copy a load needs)."""

        def __init__(self, parsed: Parsed) -> None:
            super().__init__()
            self.parsed = parsed
            self.error: Exception | None = None
            with open(parsed.path, "rb") as f:
                # A private map: writable for torch.frombuffer, never written, nothing copied.
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if len(self.map) < parsed.data_end:
                self.map.close()
                raise _bad(parsed.path, "the file shrank since it was checked")

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.parsed.metadata

        def set_up_storage_reader(
            self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                for item in plan.items:
                    self._read(item, planner)
            except Exception as exc:
                self.error = exc  # raised on this rank; DCP tells the others (see Writer)
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _read(self, item: Any, planner: Any) -> None:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                found = self.parsed.index.get((fqn, None))
                if found is None:
                    raise self._missing(fqn, None)
                at, n, _ = found
                planner.load_bytes(item, io.BytesIO(self.map[at : at + n]))
                return
            offsets = tuple(item.storage_index.offset)
            found = self.parsed.index.get((fqn, offsets))
            if found is None:
                raise self._missing(fqn, offsets)
            at, n, sizes = found
            assert sizes is not None
            md = self.parsed.metadata.state_dict_metadata[fqn]
            dtype = md.properties.dtype
            if n:
                src = (
                    torch.frombuffer(self.map, dtype=torch.uint8, count=n, offset=at).view(dtype).view(sizes)
                )
            else:
                src = torch.empty(sizes, dtype=dtype)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                if start + length > sizes[dim]:
                    raise _bad(self.parsed.path, f"a read of {fqn!r} runs past its chunk at {offsets}")
                src = src.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(item.lengths):
                raise RuntimeError(
                    f"{fqn}: the planned read {tuple(item.lengths)} and the target differ in shape"
                )
            target.copy_(src)
            del src
            planner.commit_tensor(item, target)

        def _missing(self, fqn: str, offsets: tuple[int, ...] | None) -> RuntimeError:
            where = "" if offsets is None else f" at offsets {list(offsets)}"
            return RuntimeError(
                f"this rank's snapshot ({self.parsed.path}) holds no {fqn!r}{where}: each rank loads "
                "only what it saved, so the state dict must be sharded as it was at save"
            )

        def close(self) -> None:
            try:
                self.map.close()
            except BufferError:  # a view of it still alive somewhere: the map goes with it
                pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    import types

    found = ((n, getattr(torch, n, None)) for n in _DTYPE_NAMES)
    return types.SimpleNamespace(
        torch=torch,
        dtypes={n: d for n, d in found if isinstance(d, torch.dtype)},
        dist=importlib.import_module("torch.distributed"),
        dcp=dcp,
        CheckpointException=importlib.import_module("torch.distributed.checkpoint.api").CheckpointException,
        Size=torch.Size,
        Metadata=meta.Metadata,
        TensorStorageMetadata=meta.TensorStorageMetadata,
        BytesStorageMetadata=meta.BytesStorageMetadata,
        ChunkStorageMetadata=meta.ChunkStorageMetadata,
        TensorProperties=meta.TensorProperties,
        SavePlanner=SavePlanner,
        LoadPlanner=LoadPlanner,
        Writer=Writer,
        Reader=Reader,
    )


def _same_replicas(all_plans: list[Any]) -> None:
    """Items under one index on several ranks (a replicated tensor) must agree in dtype and
    shape: each rank restores its own copy, and DCP's metadata keeps one of them."""
    seen: dict[Any, tuple[Any, ...] | None] = {}
    for plan in all_plans:
        for item in plan.items:
            td = item.tensor_data
            shape = None if td is None else (td.properties.dtype, tuple(td.size), tuple(td.chunk.sizes))
            first = seen.setdefault(item.index, shape)
            if first != shape:
                raise ValueError(
                    f"{item.index.fqn!r} differs between ranks ({first} and {shape}): a replicated "
                    "value must have one dtype and shape on every rank"
                )


def _raw(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import ctypes

    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _safe_torch_load(torch: Any, value: io.BytesIO, safe_globals: list[Any], fqn: str) -> Any:
    import pickle

    from .snapshot_torch import UnsafeSnapshot, _reason

    try:
        with torch.serialization.safe_globals(safe_globals):
            return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeSnapshot(
            f"the snapshot's item {fqn!r} holds what a weights only load does not allow "
            f"({_reason(str(exc))}); name the type in load(safe_globals=[...]) if the script saved it"
        ) from exc


def _set_path(root: Any, path: Sequence[str | int], value: Any) -> None:
    """Put ``value`` at the key path of a nested state dict (dicts and lists), as it was saved."""
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
