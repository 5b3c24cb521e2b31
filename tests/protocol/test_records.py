"""``@record`` against ``@dataclass``: the same class, declared both ways, must behave alike."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import FrozenInstanceError, InitVar, dataclass, field

import pytest

from protocol.records import record


def declare(decorator, **options):
    @decorator(**options)
    class Point:
        x: int
        y: int = 2
        tags: list[str] = field(default_factory=list)
        secret: str = field(default="s", repr=False)
        note: str = field(default="", compare=False)

    return Point


OPTIONS = [
    {},
    {"frozen": True},
    {"slots": True},
    {"frozen": True, "slots": True},
    {"kw_only": True},
    {"frozen": True, "kw_only": True, "slots": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_behaves_as_the_dataclass(options: dict) -> None:
    ours, theirs = declare(record, **options), declare(dataclass, **options)
    kw = {"x": 1, "y": 5, "tags": ["a"], "secret": "hidden", "note": "n"}
    a, b = ours(**kw), theirs(**kw)
    assert repr(a) == repr(b)
    assert "hidden" not in repr(a)
    assert [f.name for f in dataclasses.fields(a)] == [f.name for f in dataclasses.fields(b)]
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert a == ours(**{**kw, "note": "other"})  # compare=False
    assert a != ours(**{**kw, "y": 6})
    assert a.__eq__(b) is NotImplemented  # another class, even with equal fields
    assert dataclasses.replace(a, y=9).y == 9
    assert hasattr(a, "__dict__") == hasattr(b, "__dict__")
    assert ours.__match_args__ == theirs.__match_args__
    if options.get("kw_only"):
        with pytest.raises(TypeError):
            ours(1)
    else:
        assert ours(1) == ours(x=1)
        assert repr(ours(1, 3)) == repr(theirs(1, 3))
    with pytest.raises(TypeError):
        ours()  # x has no default


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_hash_and_mutability_follow_frozen(options: dict) -> None:
    cls = declare(record, **options)
    p = cls(x=1, tags=())
    if options.get("frozen"):
        assert hash(p) == hash(cls(x=1, tags=(), note="not compared"))
        with pytest.raises(FrozenInstanceError):
            p.x = 2
        with pytest.raises(FrozenInstanceError):
            del p.y
        assert p.x == 1
    else:
        with pytest.raises(TypeError):
            hash(p)
        p.x = 2
        assert p == cls(x=2, tags=())


def test_default_factory_gives_each_instance_its_own_value() -> None:
    cls = declare(record, frozen=True)
    a, b = cls(x=1), cls(x=1)
    a.tags.append("t")
    assert b.tags == []
    given: list[str] = ["mine"]
    assert cls(x=1, tags=given).tags is given


def test_post_init_runs_after_the_fields_and_may_refuse() -> None:
    @record(frozen=True, kw_only=True, slots=True)
    class Range:
        lo: int
        hi: int

        def __post_init__(self) -> None:
            if self.hi < self.lo:
                raise ValueError(f"hi {self.hi} < lo {self.lo}")

    assert Range(lo=1, hi=2).hi == 2
    with pytest.raises(ValueError, match="hi 1 < lo 2"):
        Range(lo=2, hi=1)


def test_instances_copy_and_keep_a_docstring() -> None:
    m = Module(a=1, b="x")
    assert pickle.loads(pickle.dumps(m)) == m
    assert copy.copy(m) == m
    assert copy.deepcopy(Documented(a=3)) == Documented(a=3)
    assert Module.__doc__ == "Module(a, b)"
    assert Documented.__doc__ == "Kept."


@record(frozen=True, slots=True)
class Module:
    a: int
    b: str = ""


@record
class Documented:
    """Kept."""

    a: int = 0


def test_refuses_what_it_does_not_generate() -> None:
    with pytest.raises(TypeError, match="InitVar nor init=False"):

        @record
        class Hidden:
            a: int = field(default=0, init=False)

    with pytest.raises(TypeError, match="InitVar nor init=False"):

        @record
        class WithInitVar:
            a: InitVar[int]

    with pytest.raises(TypeError, match="non-default field 'b' follows a default one"):

        @record
        class Order:
            a: int = 0
            b: int

    with pytest.raises(TypeError, match="defines __eq__"):

        @record
        class OwnEq:
            a: int

            def __eq__(self, other: object) -> bool:
                return True


def test_init_is_compiled_when_the_class_is_declared() -> None:
    """Not at the first instance: CPython 3.11's compiler must not run in a server's thread
    while another thread imports (it raised "AST constructor recursion depth mismatch" in a
    test's threaded server once)."""

    @record(frozen=True, slots=True)
    class Point:
        x: int
        y: int = 0

    declared = Point.__dict__["__init__"]
    assert Point(1).y == 0
    assert Point.__dict__["__init__"] is declared


def test_a_signal_without_a_name_is_said_once() -> None:
    """A worker killed by a real-time signal has no name: "signal 38", not "signal signal 38"."""
    import dataclasses

    from protocol import Failure
    from protocol.failure_text import how_it_failed

    f = Failure(node_id="n", addr="a", rank=0, local_rank=0, exitcode=-38, signal="signal 38", timestamp=0.0)
    assert how_it_failed(f) == "signal 38"
    assert how_it_failed(dataclasses.replace(f, signal="SIGKILL")) == "signal SIGKILL"
