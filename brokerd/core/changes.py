"""Who hears that the broker's state changed: systemd's status line, the dashboard's live
stream. Listeners subscribe; the core calls `changed()` after every grant, end, notice,
drain and queue move. A listener that fails is logged and never breaks the path that
changed."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("vaccel.brokerd")


class ChangeFeed:
    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` at every change from now on, after those subscribed before it."""
        self._listeners.append(listener)

    def changed(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # a listener must never break the path that changed
                log.exception("%s failed after a change", listener)
