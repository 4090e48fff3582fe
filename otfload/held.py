"""A process-wide setting switched on by the first of its holders and back when the last lets go.

Nested and concurrent holders (loads in several threads, a call inside another) share one switch:
``turn_on`` runs when the first holder enters and returns what ``turn_off`` needs to put things back
when the last one leaves — also when a block ends with an error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class HeldSetting:
    """``with setting.held(): ...`` — on while any block holds it (see the module)."""

    def __init__(self, turn_on: Callable[[], Any], turn_off: Callable[[Any], None]):
        self._turn_on, self._turn_off = turn_on, turn_off
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: Any = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._saved = self._turn_on()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._turn_off(self._saved)
                    self._saved = None
