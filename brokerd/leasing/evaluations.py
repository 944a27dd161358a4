"""A request judged against the host's devices (brokerd/contract), once per kind of request:
requests with the same cache key (same requirement, same client facts) share one
evaluation until the devices change, since judging a contract against 64 devices is most
of a request's cost and a lab's requests are mostly alike."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from brokerd.contract import Evaluation, Requirement, evaluate
from brokerd.devices.model import Device
from brokerd.leasing.errors import Unsatisfiable

_CAPACITY = 256


class Evaluations:
    def __init__(self) -> None:
        self._cache: dict[Hashable, Evaluation] = {}  # valid for the current devices

    def clear(self) -> None:
        """The devices changed: every evaluation is out of date."""
        self._cache.clear()

    def satisfiable(self, requirement: Requirement, devices: Iterable[Device],
                    cache_key: Hashable | None = None) -> Evaluation:
        """The evaluation of `requirement` on `devices`; Unsatisfiable (with the contract's
        reason and its first suggestion) when no set of them could ever satisfy it."""
        evaluation = self._cache.get(cache_key) if cache_key is not None else None
        if evaluation is None:
            evaluation = evaluate(requirement, list(devices))
            if cache_key is not None:
                if len(self._cache) >= _CAPACITY:
                    self._cache.clear()
                self._cache[cache_key] = evaluation
        if not evaluation.satisfiable:
            message = evaluation.reason or "no device on this host satisfies the request"
            if evaluation.suggestions:
                message += f" (suggestion: {evaluation.suggestions[0]})"
            raise Unsatisfiable(message, evaluation)
        return evaluation
