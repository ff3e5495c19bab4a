"""The record writer: turns what each request left behind into its `RequestRecord`, appends it to requests.jsonl and
shows it to the observers, on a thread of its own, so none of that runs on the event loop that stamps arrivals.

On the loop, a finished request costs one queue append (`submit`). Deriving a record (SSE and SGLang's JSON of
every chunk) costs about a millisecond for a 64-chunk chat stream; in a closed loop with fixed output lengths every
stream ends in the same few milliseconds, and the loop would do that work for each of them while the next burst's
first chunks arrive. Here it is done in batches: each wake-up takes whatever is queued, derives it in order, writes
the lines and flushes once, then tells the observers. A crash loses the requests in flight and what was queued in
the last milliseconds, never a written line.

The writer thread runs at a lower scheduling priority, and the interpreter's switch interval is shortened while it
runs, so that the loop, waking for a read, waits at most that interval for the GIL rather than the default 5 ms.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from dfserve.loadtest.records import RequestRecord
from dfserve.runs import JsonlAppender

Raw = TypeVar("Raw")
Observer = Callable[[RequestRecord], None]

SWITCH_INTERVAL_S = 2e-4
"""The longest the loop waits for the GIL while the writer is busy (the interpreter's default is 5 ms)."""
NICENESS = 10


class RecordWriter(Generic[Raw]):
    """`submit` raw results from the loop; `close` writes what is left and returns every record, in submit order."""

    def __init__(self, derive: Callable[[Raw], RequestRecord], appender: JsonlAppender,
                 observers: Sequence[Observer]) -> None:
        self._derive = derive
        self._appender = appender
        self._observers = observers
        self._queue: queue.SimpleQueue[Raw | None] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self.records: list[RequestRecord] = []
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="dfserve-record-writer", daemon=True)
        self._thread.start()

    def submit(self, raw: Raw) -> None:
        self._queue.put(raw)

    def close(self) -> list[RequestRecord]:
        """Write everything submitted, stop the thread; re-raises what failed in it (a full disk, an observer)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            sys.setswitchinterval(self._switch_interval)
        if self._failure is not None:
            raise self._failure
        return self.records

    def _run(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)  # Linux: niceness is per thread
        try:
            while True:
                batch = [self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get())
                done = batch[-1] is None
                records = [self._derive(raw) for raw in batch if raw is not None]
                self._appender.extend(records)
                self.records.extend(records)
                for record in records:
                    for observe in self._observers:
                        observe(record)
                if done:
                    return
        except BaseException as exc:  # handed to close(), which re-raises it on the caller's thread
            self._failure = exc
