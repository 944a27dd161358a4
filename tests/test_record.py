"""vaccel_common/record.py: typing.NamedTuple's class syntax without typing (the quick
container path imports no typing: issue 45 item 4). What the records of the client rely on."""

from __future__ import annotations

import pickle

import pytest
from vaccel.containers.engine_command import Option
from vaccel.session.lease import DeviceInfo, LeaseEnding

from vaccel_common.backends import BACKENDS, ContainerFacts
from vaccel_common.record import record


@record
class Point:
    """A point."""

    x: int
    y: int
    label: str = ""
    tags: tuple[str, ...] = ()

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)

    def moved(self, dx: int) -> Point:
        return self._replace(x=self.x + dx)


def test_fields_defaults_and_methods_are_the_classes():
    p = Point(1, -2)
    assert (p.x, p.y, p.label, p.tags) == (1, -2, "", ())
    assert Point._fields == ("x", "y", "label", "tags") and Point._field_defaults == {"label": "", "tags": ()}
    assert p.norm1 == 3 and p.moved(2) == Point(3, -2)
    assert Point(1, 2, label="a") == (1, 2, "a", ()) and hash(Point(1, 2)) == hash((1, 2, "", ()))
    x, y, *_ = p
    assert (x, y) == (1, -2)
    assert Point.__doc__ == "A point." and Point.__name__ == "Point" and Point.__module__ == __name__
    assert Point.__qualname__ == "Point" and repr(p) == "Point(x=1, y=-2, label='', tags=())"
    assert not hasattr(p, "__dict__")  # a tuple, no instance dict
    with pytest.raises(AttributeError):
        p.x = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Point(1)  # type: ignore[call-arg]


def test_a_record_pickles_as_itself():
    p = Point(1, 2, "a", ("t",))
    assert pickle.loads(pickle.dumps(p)) == p and type(pickle.loads(pickle.dumps(p))) is Point


def test_a_field_without_a_default_after_one_with_is_refused_as_namedtuple_does():
    with pytest.raises(TypeError, match="follows one with a default"):
        @record
        class Bad:
            a: int = 0
            b: int


def test_the_clients_records_keep_their_shape():
    assert ContainerFacts()._fields[0] == "docker_gpus" and BACKENDS["cuda"].container.docker_gpus
    assert BACKENDS["cpu"].container == ContainerFacts()
    assert Option("--rm", None, "--rm").on and not Option("--rm", "false", "--rm=false").on
    device = DeviceInfo(0, "GPU-0", "Sim", 1024, "nvidia", "8.0", True, "0")
    assert device.device_nodes == () and device.label == ""
    assert str(LeaseEnding("l-1", 0.0, 59.2, "time limit of 1h")) == "lease l-1 ends in 1m00s: time limit of 1h"
