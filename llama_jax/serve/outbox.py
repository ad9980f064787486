"""Events from the engine thread to the event loop's queues, handed over in batches: the loop
is woken once for every event posted before it gets to run (a program's, for every choice it
advanced), not once per event. A wake-up is a write to the loop's self-pipe and a pass of its
selector; eight choices stepping a token at a time made eight a step."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: `item` into `queue`, on the loop, after those posted before it."""
        with self._lock:
            self._posted.append((queue, item))
            if len(self._posted) > 1:  # a hand-over is scheduled already
                return
        self.loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for queue, item in posted:
            queue.put_nowait(item)
