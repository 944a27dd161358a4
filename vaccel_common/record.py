"""`@record`: typing.NamedTuple's class syntax on collections.namedtuple.

For the modules a quick `vaccel run -- docker run ...` imports (issue 45, item 4): `typing`
costs about 7 ms of that run's ~40 ms on a 2-core machine, `collections` nothing (the
interpreter has imported it already).

    @record
    class LeasedDevice:
        index: int
        uuid: str
        device_nodes: tuple[str, ...] = ()

        @property
        def first_node(self) -> str: ...

The fields are the class's annotations, in order; a field given a value has it as its
default (defaults come last, as in NamedTuple); the class's methods, properties and
docstring are kept. The result is a subclass of the namedtuple with no instance dict, so
it is a tuple as a NamedTuple is: equal to, and unpacked like, its fields.
"""

from __future__ import annotations

from collections import namedtuple

TYPE_CHECKING = False  # typing.TYPE_CHECKING's value, without importing typing
if TYPE_CHECKING:
    from typing import TypeVar

    T = TypeVar("T")

_CLASS_ONLY = ("__dict__", "__weakref__")


def record(cls: type[T]) -> type[T]:
    names = list(cls.__annotations__)  # the class's own (never a base's, from Python 3.10), in order
    defaults = [cls.__dict__[name] for name in names if name in cls.__dict__]
    given = [name in cls.__dict__ for name in names]
    if given != sorted(given):
        raise TypeError(f"{cls.__name__}: a field without a default follows one with a default")
    base = namedtuple(cls.__name__, names, defaults=defaults, module=cls.__module__)  # type: ignore[misc]
    body = {key: value for key, value in cls.__dict__.items() if key not in names and key not in _CLASS_ONLY}
    body["__slots__"] = ()
    return type(cls.__name__, (base,), body)  # type: ignore[return-value]
