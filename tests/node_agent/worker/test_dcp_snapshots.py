"""dcp_snapshots: sharded state (FSDP2, DTensor) through torch.distributed.checkpoint into the
rank's snapshot file and the file format's checks, in this process (two real gloo ranks:
test_dcp_snapshots_gloo.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node_agent.worker import dcp_snapshots as D
from node_agent.worker import snapshots as S
from node_agent.worker.snapshot_torch import UnsafeSnapshot

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
_VARS = (S.DIR_VAR, S.LIMIT_VAR, S.RESTORE_VAR, S.DIGEST_VAR, "NODE_AGENT_PROGRESS_PAGE")


@pytest.fixture
def rank_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "r0"
    d.mkdir()
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(S.DIR_VAR, str(d))
    return d


def mixed_state() -> dict[str, Any]:
    return {
        "w": torch.arange(10, dtype=torch.float32),
        "nested": {"bf16": torch.randn(3, 5).to(torch.bfloat16), "n": 5, "betas": [0.9, (0.9, 0.99)]},
        "scalar": torch.tensor(3),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12).view(3, 4).t(),  # not contiguous
        "flags": torch.tensor([True, False, True]),
        "c64": torch.randn(4, dtype=torch.complex64),
    }


def zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        else:
            out[k] = None
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def the_file(d: Path) -> Path:
    (f,) = [p for p in d.iterdir() if p.name.endswith(S.SUFFIX)]
    return f


# ---------------------------------------------------------------------------------------------
# In one process (no process group: a world of one)


def test_a_state_dict_comes_back_bit_identical(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = mixed_state()
    D.save(7, sd)
    assert [p.name for p in rank_dir.iterdir()] == [S.step_name(7)]
    monkeypatch.setenv(S.RESTORE_VAR, "7")
    target = zeros_like_state(sd)
    assert D.load(target) == 7
    assert_same(sd, target)


def test_nothing_to_restore_is_none_and_the_state_is_untouched(rank_dir: Path) -> None:
    D.save(1, mixed_state())
    target = zeros_like_state(mixed_state())
    assert D.load(target) is None
    assert_same(target, zeros_like_state(mixed_state()))


def test_outside_node_agent_save_discards_and_load_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    D.save(3, mixed_state())
    assert list(tmp_path.iterdir()) == []
    assert D.load(zeros_like_state(mixed_state())) is None


def test_save_runs_in_the_snapshot_phase(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = D.phase

    def spy(name: str) -> Any:
        seen.append(name)
        return real(name)

    monkeypatch.setattr(D, "phase", spy)
    D.save(2, {"x": torch.ones(2)})
    assert seen == ["snapshot"]


def test_a_missing_file_of_the_restore_step_raises(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(S.RESTORE_VAR, "9")
    with pytest.raises(S.SnapshotMissing, match="no snapshot of it"):
        D.load({"x": torch.zeros(2)})


class Opaque:
    def __init__(self) -> None:
        self.v = 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v

    __hash__ = None  # type: ignore[assignment]


def test_non_tensor_items_are_unpickled_weights_only(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    D.save(4, {"x": torch.ones(2), "cfg": Opaque()})
    monkeypatch.setenv(S.RESTORE_VAR, "4")
    with pytest.raises(UnsafeSnapshot, match="'cfg'"):
        D.load({"x": torch.zeros(2), "cfg": None})
    target: dict[str, Any] = {"x": torch.zeros(2), "cfg": None}
    assert D.load(target, safe_globals=[Opaque]) == 4
    assert target["cfg"] == Opaque() and torch.equal(target["x"], torch.ones(2))


def test_a_differently_sharded_state_is_refused_by_name(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    D.save(5, {"x": torch.ones(4)})
    monkeypatch.setenv(S.RESTORE_VAR, "5")
    with pytest.raises(ValueError, match="Size mismatch"):  # DCP's own error, raised as itself
        D.load({"x": torch.zeros(5)})


# ---------------------------------------------------------------------------------------------
# The format: round trip and its checks


def write_file(path: Path, doc: dict[str, Any] | bytes, region: bytes, **header: Any) -> None:
    """A snapshot file of ``doc`` (JSON, or raw bytes) after the data ``region``; ``header``
    overrides the header's fields (magic, version, flags, data, meta)."""
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    fields = {"magic": D.MAGIC, "version": D.VERSION, "flags": 0, "data": len(region), "meta": len(raw)}
    fields.update(header)
    head = D.HEADER.pack(fields["magic"], fields["version"], fields["flags"], fields["data"], fields["meta"])
    path.write_bytes(head + region + raw)


def sample(rank_dir: Path) -> tuple[dict[str, Any], bytes]:
    """A real file's metadata document and data region (saved by dcp_snapshots.save)."""
    D.save(6, {"w": torch.arange(8, dtype=torch.float32), "m": {"n": 3}})
    raw = the_file(rank_dir).read_bytes()
    _, _, _, data_len, _ = D.HEADER.unpack(raw[: D.HEADER_SIZE])
    data = raw[D.HEADER_SIZE : D.HEADER_SIZE + data_len]
    return json.loads(raw[D.HEADER_SIZE + data_len :]), data


def test_the_format_round_trips_dcp_metadata(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def chunk(o: list[int], s: list[int]) -> Any:
        return ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))

    md = Metadata(
        state_dict_metadata={
            "a.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, requires_grad=True),
                torch.Size([4, 3]),
                [chunk([0, 0], [2, 3]), chunk([2, 0], [2, 3])],
            ),
            "s": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]), [chunk([], [])]),
            "lr": BytesStorageMetadata(),
        },
        planner_data={"a.w": ("a", "w"), "s": ("s",), "lr": ("groups", 0, "lr")},
    )
    items = [("a.w", (2, 0), (2, 3), 64, 12), ("s", (), (), 128, 8), ("lr", None, None, 192, 5)]
    doc = D.encode_metadata(md, items, step=11, rank=1, world_size=2)
    write_file(tmp_path / "f", doc, bytes(192 + 5 - D.HEADER_SIZE))
    p = D.parse(str(tmp_path / "f"))
    assert p.metadata.state_dict_metadata == md.state_dict_metadata
    assert p.metadata.planner_data == md.planner_data
    assert (p.step, p.rank, p.world_size) == (11, 1, 2)
    assert p.index == {
        ("a.w", (2, 0)): (64, 12, (2, 3)),
        ("s", ()): (128, 8, ()),
        ("lr", None): (192, 5, None),
    }


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ({"magic": b"PK\x03\x04\0\0\0\0"}, "no dcp_snapshots header"),
        ({"version": 2}, "format version 2"),
        ({"flags": 1}, "unknown flags"),
        ({"meta": D.MAX_METADATA + 1}, "more than"),
        ({"meta": 1 << 62}, "more than"),
        ({"data": (1 << 64) - 1}, "truncated or damaged"),
        ({"data": 0}, "truncated or damaged"),
    ],
)
def test_a_bad_header_is_refused(rank_dir: Path, header: dict[str, Any], why: str) -> None:
    doc, data = sample(rank_dir)
    write_file(rank_dir / "bad", doc, data, **header)
    with pytest.raises(D.SnapshotFormatError, match=why):
        D.parse(str(rank_dir / "bad"))


def test_a_truncated_or_extended_file_is_refused_wherever_cut(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    D.save(8, mixed_state())
    f = the_file(rank_dir)
    whole = f.read_bytes()
    monkeypatch.setenv(S.RESTORE_VAR, "8")
    cuts = sorted({*range(0, len(whole), 97), D.HEADER_SIZE - 1, D.HEADER_SIZE, len(whole) - 1})
    for cut in [*cuts, len(whole) + 1]:
        f.write_bytes(whole[:cut] if cut < len(whole) else whole + b"\0")
        with pytest.raises(D.SnapshotFormatError, match=r"shorter than|truncated or damaged"):
            D.load(zeros_like_state(mixed_state()))
    f.write_bytes(whole)
    assert D.load(zeros_like_state(mixed_state())) == 8


def mutate(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``doc`` with the value at a dotted path (list indices as numbers) replaced; ``...``
    deletes it."""
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key_: Any = int(last) if isinstance(node, list) else last
    if value is ...:
        del node[key_]
    else:
        node[key_] = value
    return doc


def huge_step(doc: dict[str, Any]) -> bytes:
    text = json.dumps(doc)
    assert '"step": 6' in text
    return text.replace('"step": 6', '"step": ' + "9" * 5000).encode()


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | bytes], str]] = [
    ("not json", lambda d: b"\x80not json", "not JSON"),
    ("deep nesting", lambda d: b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ("a list", lambda d: b"[]", "keys"),
    ("a key missing", lambda d: mutate(d, "items", ...), "keys"),
    ("a key more", lambda d: mutate(d, "extra", 1), "keys"),
    ("world size 0", lambda d: mutate(d, "world_size", 0), "world_size"),
    ("world size a bool", lambda d: mutate(d, "world_size", True), "world_size"),
    ("rank past the world", lambda d: mutate(d, "rank", 1), "rank"),
    ("negative step", lambda d: mutate(d, "step", -1), "step"),
    ("a float step", lambda d: mutate(d, "step", 6.0), "step"),
    ("unknown dtype", lambda d: mutate(d, "tensors.w.dtype", "object"), "unknown dtype"),
    ("dtype not a string", lambda d: mutate(d, "tensors.w.dtype", [1]), "unknown dtype"),
    ("too many dims", lambda d: mutate(d, "tensors.w.size", [1] * 65), "dimensions"),
    ("a negative size", lambda d: mutate(d, "tensors.w.size", [-8]), "integer"),
    ("chunk outside", lambda d: mutate(d, "tensors.w.chunks.0.offsets", [1]), "outside its size"),
    ("chunk of other rank", lambda d: mutate(d, "tensors.w.chunks.0.sizes", [2]), "no chunk"),
    ("item outside data", lambda d: mutate(d, "items.0.at", 1 << 40), "start of"),
    ("item too long", lambda d: mutate(d, "items.0.nbytes", 1 << 40), "length of"),
    ("item misaligned", lambda d: mutate(d, "items.0.at", D.HEADER_SIZE + 4), "multiple of"),
    ("item in the header", lambda d: mutate(d, "items.0.at", 0), "start of"),
    ("item short", lambda d: mutate(d, "items.0.nbytes", 16), "bytes for"),
    ("item of no tensor", lambda d: mutate(d, "items.0.fqn", "nope"), "does not hold"),
    ("item twice", lambda d: mutate(d, "items", [d["items"][0], d["items"][0]]), "twice"),
    ("bytes item with offsets", lambda d: mutate(d, "items.1.offsets", [0]), "offsets or sizes"),
    ("bytes name reused", lambda d: mutate(d, "bytes", ["w"]), "not a new string"),
    ("bad key path", lambda d: mutate(d, "planner_data.w", [{"a": 1}]), "key path"),
    ("huge number", lambda d: huge_step(d), "JSON"),
]


@pytest.mark.parametrize(("name", "change", "why"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_metadata_is_refused_with_a_clear_error(
    rank_dir: Path, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | bytes], why: str
) -> None:
    doc, data = sample(rank_dir)
    assert doc["items"][0]["fqn"] == "w" and doc["items"][1]["fqn"] == "m.n", doc["items"]
    write_file(rank_dir / "bad", change(doc), data)
    with pytest.raises(D.SnapshotFormatError, match=why):
        D.parse(str(rank_dir / "bad"))


def test_another_world_size_is_refused_naming_both(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, data = sample(rank_dir)
    f = the_file(rank_dir)
    write_file(f, mutate(mutate(doc, "world_size", 4), "rank", 0), data)
    monkeypatch.setenv(S.RESTORE_VAR, "6")
    with pytest.raises(D.WorldSizeMismatch, match=r"world of 4 ranks and this world has 1"):
        D.load({"w": torch.zeros(8), "m": {"n": 0}})


def test_a_file_of_another_step_or_rank_is_refused(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, data = sample(rank_dir)
    f = the_file(rank_dir)
    monkeypatch.setenv(S.RESTORE_VAR, "6")
    write_file(f, mutate(doc, "step", 5), data)
    with pytest.raises(D.SnapshotFormatError, match="holds step 5"):
        D.load({"w": torch.zeros(8), "m": {"n": 0}})
    write_file(f, mutate(mutate(doc, "world_size", 2), "rank", 1), data)
    with pytest.raises(D.WorldSizeMismatch):
        D.load({"w": torch.zeros(8), "m": {"n": 0}})


# ---------------------------------------------------------------------------------------------
# Two ranks, gloo, FSDP2 and DTensors
