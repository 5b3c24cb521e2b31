"""``@record``: a dataclass that costs less to declare.

Python 3.11's ``dataclasses.dataclass`` writes and compiles the source of every method it
generates: a frozen, slotted class costs six compilations (``__init__``, ``__repr__``,
``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``), about 0.8 ms.  Some sixty classes
(messages, events, effects, config) are declared when ``node-agent`` starts, which made
dataclass code generation the largest part of a launch after the interpreter itself.

``record`` lets ``dataclasses`` collect the fields (so ``fields``, ``replace`` and ``asdict``
work as before) and compiles only ``__init__``, the one method whose speed matters (the
server builds thousands of messages a round).  The others are shared functions that read a
per-class ``operator.attrgetter`` of the compared fields, which is C code.  ``__init__`` is
compiled when the class is declared (at import), not at its first instance: CPython 3.11's
compiler is not safe to run in two threads at once ("AST constructor recursion depth
mismatch"), and a first instance may be made in any thread (an embedded server's, a daemon's)
while another imports.

The methods behave as dataclass's do for what we use: positional or keyword-only parameters,
defaults and ``default_factory``, ``__post_init__``, per-field ``repr`` and ``compare``;
``frozen`` raises ``dataclasses.FrozenInstanceError`` on assignment and makes instances
hashable by their compared fields; an ``eq`` class that is not frozen is unhashable.  Refused:
``InitVar`` and ``init=False`` fields, and a class body that defines a method we provide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import attrgetter
from types import MemberDescriptorType
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    # Lets type checkers see fields and constructors, as they do for @dataclass.  Only under
    # TYPE_CHECKING: typing has it from 3.11 only, and typing_extensions is no dependency.
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda fn: fn


__all__ = ["record"]

T = TypeVar("T", bound=type)
_dataclass = dataclasses.dataclass


class _Factory:
    """The default of a ``default_factory`` parameter: "call the factory"."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


@overload
@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def record(cls: T, /) -> T: ...
@overload
def record(*, frozen: bool = ..., kw_only: bool = ..., slots: bool = ...) -> Callable[[T], T]: ...


def record(
    cls: T | None = None, /, *, frozen: bool = False, kw_only: bool = False, slots: bool = False
) -> T | Callable[[T], T]:
    """Like ``@dataclass(frozen=..., kw_only=..., slots=...)``; see the module header."""

    def wrap(c: T) -> T:
        return _build(c, frozen=frozen, kw_only=kw_only, slots=slots)

    return wrap if cls is None else wrap(cls)


def _build(cls: T, *, frozen: bool, kw_only: bool, slots: bool) -> T:
    body = cls.__dict__
    provided = ("__init__", "__repr__", "__eq__", *(_FROZEN_METHODS if frozen else ()))
    for name in provided:
        if name in body:
            raise TypeError(f"{cls.__qualname__} defines {name}, which @record generates")
    docless = not cls.__doc__
    if docless:
        # Else dataclass builds one from inspect.signature, which tokenizes a text signature.
        cls.__doc__ = cls.__name__
    # Any: the methods and class attributes set below are ones a type checker cannot model.
    built: Any = _dataclass(cls, init=False, repr=False, eq=False, kw_only=kw_only, slots=slots)
    fields = dataclasses.fields(built)
    for f in built.__dataclass_fields__.values():
        # _FIELD_INITVAR is private (typeshed omits it), and the one way to spot an InitVar field.
        if not f.init or f._field_type is dataclasses._FIELD_INITVAR:  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__qualname__}.{f.name}: @record supports neither InitVar nor init=False")

    built.__init__ = _init_fn(built, fields, frozen)
    built._record_shown = tuple(f.name for f in fields if f.repr)
    built._record_key = _getter([f.name for f in fields if f.compare])
    built.__repr__ = _repr
    built.__eq__ = _eq
    if frozen:
        built.__setattr__ = _refuse_set
        built.__delattr__ = _refuse_del
        if "__hash__" not in body:
            hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
            built._record_hash_key = _getter(hashed)
            built.__hash__ = _hash
        if slots:
            # No __dict__ to restore into, and __setattr__ refuses: copy and pickle need these.
            built._record_names = tuple(f.name for f in fields)
            built._record_all = _getter(list(built._record_names))
            built.__getstate__ = _getstate
            built.__setstate__ = _setstate
    elif "__hash__" not in body:
        built.__hash__ = None  # mutable and compared by value, as dataclass does
    if docless:
        built.__doc__ = f"{cls.__name__}({', '.join(f.name for f in fields)})"
    return built


def _init_fn(cls: type, fields: tuple[dataclasses.Field[Any], ...], frozen: bool) -> Callable[..., None]:
    src, env = _init_source(cls, fields, frozen)
    exec(src, env)  # the source is built from field names only
    fn: Callable[..., None] = env["__init__"]
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    return fn


def _init_source(
    cls: type, fields: tuple[dataclasses.Field[Any], ...], frozen: bool
) -> tuple[str, dict[str, Any]]:
    """The source of a record class's ``__init__`` and the names it reads."""
    env: dict[str, Any] = {"__builtins__": __builtins__, "_set": object.__setattr__, "_FACTORY": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    assign: list[str] = []
    seen_default = False
    for f in fields:
        param = f.name
        value = f.name
        if f.default is not dataclasses.MISSING:
            env[f"_d_{f.name}"] = f.default
            param += f"=_d_{f.name}"
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_f_{f.name}"] = f.default_factory
            param += "=_FACTORY"
            value = f"_f_{f.name}() if {f.name} is _FACTORY else {f.name}"
        if f.kw_only:
            keyword.append(param)
        else:
            if "=" in param:
                seen_default = True
            elif seen_default:
                raise TypeError(f"{cls.__qualname__}: non-default field {f.name!r} follows a default one")
            positional.append(param)
        if not frozen:
            assign.append(f"self.{f.name} = {value}")
        elif isinstance(slot := cls.__dict__.get(f.name), MemberDescriptorType):
            # A slot's own setter: what object.__setattr__ ends in, without its lookup (a
            # third of a frozen message's construction; the server builds 10,000 a second).
            env[f"_s_{f.name}"] = slot.__set__
            assign.append(f"_s_{f.name}(self, {value})")
        else:
            assign.append(f"_set(self, {f.name!r}, {value})")
    if hasattr(cls, "__post_init__"):
        assign.append("self.__post_init__()")
    params = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    src = "\n".join([f"def __init__({params}) -> None:", *(f"    {line}" for line in assign or ["pass"])])
    return src, env


_FROZEN_METHODS = ("__setattr__", "__delattr__")


def _getter(names: list[str]) -> staticmethod[[Any], tuple[Any, ...]]:
    """A C-speed function from an instance to the tuple of these attributes, to keep on a class."""
    if len(names) >= 2:
        return staticmethod(attrgetter(*names))
    if names:
        one = attrgetter(names[0])
        return staticmethod(lambda obj: (one(obj),))
    return staticmethod(lambda obj: ())


def _repr(self: Any) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._record_shown)
    return f"{self.__class__.__qualname__}({shown})"


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is self.__class__:
        return self._record_key(self) == other._record_key(other)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(self._record_hash_key(self))


def _refuse_set(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _refuse_del(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _getstate(self: Any) -> tuple[Any, ...]:
    return self._record_all(self)


def _setstate(self: Any, state: tuple[Any, ...]) -> None:
    for name, value in zip(self._record_names, state, strict=True):
        object.__setattr__(self, name, value)
