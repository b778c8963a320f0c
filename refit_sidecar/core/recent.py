"""`Recent`: the last few values computed by key, for tables a refit rebuilds from its plan
every version otherwise. Shared by the pulls of a process (a receiver's ranks pull at once,
from threads)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class Recent:
    def __init__(self, capacity: int = 8) -> None:
        self._values: OrderedDict[Any, Any] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value held for `key`, else `make()`'s (held; the least recently used beyond
        the capacity dropped)."""
        with self._lock:
            value = self._values.get(key)
            if value is None:
                value = self._values[key] = make()
                while len(self._values) > self._capacity:
                    self._values.popitem(last=False)
            self._values.move_to_end(key)
            return value
