"""The probe interface: one small class per vendor, each answering "what is here, and why not".

A probe's `probe()` is blocking (management-library calls) and must never raise:
whatever goes wrong becomes the verdict's reason. The daemon runs it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from brokerd.devices.model import ProbeResult, ProbeVerdict


class Probe(Protocol):
    vendor: str

    def probe(self) -> ProbeResult:
        """Return the devices found, or an unavailable verdict saying why none were."""
        ...


def library_loads(name: str) -> bool:
    """Whether the dynamic loader finds the shared library `name` (a driver's management
    library): what a host lacks is named by it, not by the Python binding that wraps it."""
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def unavailable(vendor: str, reason: str) -> ProbeResult:
    return ProbeResult(verdict=ProbeVerdict(vendor=vendor, available=False, reason=reason))


@dataclass(frozen=True)
class Unavailable:
    """A device fact the management library could not give; `reason` says why.

    Falsy, so `value or default` reads naturally where a default is fine."""

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass
class FieldLog:
    """What one device's reads produced beyond the values: which fields were missing and
    whether the device stopped answering part-way."""

    missing: dict[str, str] = field(default_factory=dict)
    lost: str = ""  # non-empty once the device has stopped answering: the reason


class FieldReader:
    """The one query wrapper around a management library's calls for one device: a call
    that fails degrades that field to `Unavailable`, never the whole device. Each probe
    subclasses it with its library's error type and what its error codes mean."""

    package = ""  # the Python package, for "... is not in this <package>"

    def __init__(self, library: Any, error_type: type[BaseException], log: FieldLog) -> None:
        self.library = library
        self.error_type = error_type
        self.log = log

    def get(self, key: str, function: str, *args: Any) -> Any:
        """Call `library.<function>(*args)`; on failure record `key` as missing and return
        the `Unavailable` value."""
        value = self.call(function, *args)
        if isinstance(value, Unavailable):
            self.log.missing.setdefault(key, value.reason)
        return value

    def call(self, function: str, *args: Any) -> Any:
        """Call `library.<function>(*args)`, turning the library's errors into `Unavailable`."""
        if self.log.lost:
            return Unavailable(self.log.lost)
        fn = getattr(self.library, function, None)
        if fn is None:
            return Unavailable(f"{function} is not in this {self.package}")
        try:
            return fn(*args)
        except self.error_type as exc:
            return self.classify(exc)

    def classify(self, exc: BaseException) -> Unavailable:
        """What a library error means for the field; set `log.lost` when the device is gone."""
        raise NotImplementedError
