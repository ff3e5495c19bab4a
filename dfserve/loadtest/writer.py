"""The record writer: a process of its own turns what each request left behind into its `RequestRecord` and appends
it to requests.jsonl, so none of that runs on the event loop that stamps arrivals, nor holds its GIL.

Deriving a record costs about 0.1 ms for a 64-chunk chat stream (bench/derive_cost.py; about 0.4 ms when every
event's JSON was decoded), still CPU the tester's core spends while streams run. In a closed loop with fixed output lengths every stream ends within the same few milliseconds, and the loop used to
do that work for each of them while the next burst's first chunks arrived; a thread would still take the GIL from
the loop for that work (the two take turns holding it). On the loop a finished request now costs one `marshal` of its
stamps and pieces (`Finished.wire`) and a pipe write that never blocks (the loop's pipe transport buffers).

The writer process (`python -m dfserve.loadtest.writer PATH`, niced) is started and ready before the run's
clock starts; its first frame is the run's start (`begin`). It reads frames in batches: whatever has arrived when
it wakes is derived in order, written and flushed once, then echoed as JSON lines to its stdout. A thread of the
caller's reads them back (a validation and the observers, tens of microseconds a record) and keeps the records.
When the caller dies, the writer still reads to the end of its pipe (1 MiB, about 80 chat streams of 64 chunks)
and writes every request in it: a crash loses the requests in flight, and only if the writer had fallen further
behind than its pipe holds, the finished ones still waiting in the caller.

When the file cannot be written (a full disk: ENOSPC), the writer says so in one line on its stderr, stops echoing
and reads the caller's frames to their end without writing them, so the loop's writes never fail; the caller sees
its echo end early, stops sending (`stopped`), and `close` returns the records that were written with `lost`
saying what was not. The run is then kept as an interrupted one, never judged as if complete.
"""

from __future__ import annotations

import asyncio
import fcntl
import marshal
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, cast

from dfserve.errors import UserError
from dfserve.loadtest.client import Finished, Wire, derive
from dfserve.loadtest.records import RequestRecord
from dfserve.runs import JsonlAppender

Observer = Callable[[RequestRecord], None]

NICENESS = 10
"""The writer yields the CPU to the loop whenever both want it (a tester pinned to one core)."""
SWITCH_INTERVAL_S = 2e-4
"""The longest the loop waits for the GIL while the reading thread runs observers (the interpreter's default: 5 ms)."""
LENGTH = 4
PIPE_BYTES = 1 << 20
"""Linux's largest pipe for an unprivileged process (/proc/sys/fs/pipe-max-size); the default is 64 KiB."""
READY = b"ready\n"
WRITE_FAILED = 3
"""The writer's exit status when its file could not be written; its stderr's last line says why."""


def frame(finished: Finished | float) -> bytes:
    """A finished request, or the run's start (the first frame)."""
    data = marshal.dumps(finished.wire() if isinstance(finished, Finished) else finished)
    return len(data).to_bytes(LENGTH, "little") + data


def _read_frame(source: IO[bytes]) -> object | None:
    """The next frame's value; None at the end, or at a frame cut short (the caller killed mid-write)."""
    head = source.read(LENGTH)
    if len(head) < LENGTH:
        return None
    size = int.from_bytes(head, "little")
    data = source.read(size)
    return marshal.loads(data) if len(data) == size else None


def read_frames(source: IO[bytes]) -> list[Finished] | None:
    """The frames that have arrived: waits for the first, takes the others without waiting; None at the end."""
    batch: list[Finished] = []
    while not batch or select.select([source], [], [], 0)[0]:
        wire = _read_frame(source)
        if wire is None:
            return batch or None
        batch.append(Finished.from_wire(cast(Wire, wire)))
    return batch


def write_records(source: IO[bytes], appender: JsonlAppender, echo: IO[bytes]) -> None:
    """The writer process's work: the run's start, then every batch derived (each request by its own route),
    appended with one flush, then echoed (while anyone reads)."""
    t0 = _read_frame(source)
    if not isinstance(t0, float):
        return  # the caller ended before its run began
    echoing = True
    while (batch := read_frames(source)) is not None:
        lines = [derive(t0, finished).model_dump_json() + "\n" for finished in batch]
        appender.write_lines(lines)
        if echoing:
            try:
                echo.write("".join(lines).encode())
                echo.flush()
            except BrokenPipeError:
                echoing = False  # the caller died: keep writing the file


def _spawn(path: Path) -> subprocess.Popen[bytes]:
    """The writer process (a fork and exec: nothing to wait for); the loop writes to its stdin through a transport."""
    process = subprocess.Popen([sys.executable, "-m", __name__, str(path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin is not None
    fcntl.fcntl(process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return process


class _Closed(asyncio.Protocol):
    def __init__(self) -> None:
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class RecordWriterError(UserError):
    """The record writer could not start, or failed other than on its file."""


def _last_line(process: subprocess.Popen[bytes]) -> str:
    """The last line the writer wrote on its stderr (read once it has exited), or its exit status."""
    assert process.stderr is not None
    with process.stderr:
        lines = process.stderr.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {process.returncode}"


class RecordWriter:
    """`submit` finished requests from the loop; `close` waits until all are written, returns them in submit order."""

    def __init__(self, process: subprocess.Popen[bytes], transport: asyncio.WriteTransport, protocol: _Closed,
                 observers: Sequence[Observer]) -> None:
        self._process = process
        self._transport = transport
        self._protocol = protocol
        self._observers = observers
        self._failure: BaseException | None = None
        self._submitted = 0
        self.records: list[RequestRecord] = []
        self.lost: str | None = None
        """Set by `close` when the file could not be written: why, and how many finished requests were not."""
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._read_back, name="dfserve-record-reader", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, path: Path, observers: Sequence[Observer]) -> RecordWriter:
        """Start the writer process on `path` (a new file: it creates it); returns once it is ready."""
        process = _spawn(path)
        assert process.stdin is not None and process.stdout is not None
        if await asyncio.to_thread(process.stdout.readline) != READY:
            process.stdin.close()
            process.stdout.close()
            await asyncio.to_thread(process.wait)
            raise RecordWriterError(f"the record writer did not start: {_last_line(process)}")
        transport, protocol = await asyncio.get_running_loop().connect_write_pipe(_Closed, process.stdin)
        return cls(process, transport, protocol, observers)

    def begin(self, t0: float) -> None:
        """The run's start on the clock the pieces are stamped with; before the first `submit`."""
        self._transport.write(frame(t0))

    def submit(self, finished: Finished) -> None:
        self._submitted += 1
        self._transport.write(frame(finished))

    def stopped(self) -> bool:
        """Whether the writer stopped writing before `close` (its file could not be written): send nothing more."""
        return not self._thread.is_alive() and not self._transport.is_closing()

    async def close(self) -> list[RequestRecord]:
        """Write everything submitted and stop; re-raises what failed (the writer process, an observer)."""
        if not self._transport.is_closing():
            self._transport.close()
            await self._protocol.closed
            await asyncio.to_thread(self._thread.join)
            sys.setswitchinterval(self._switch_interval)
        status = await asyncio.to_thread(self._process.wait)
        reason = _last_line(self._process)
        if self._failure is not None:
            raise self._failure
        if status == WRITE_FAILED:
            self.lost = (f"{reason}: {self._submitted - len(self.records)} of {self._submitted} finished requests "
                         "were not written")
        elif status != 0:
            raise RecordWriterError(f"the record writer failed: {reason}")
        return self.records

    def _read_back(self) -> None:
        assert self._process.stdout is not None
        try:
            for line in self._process.stdout:
                record = RequestRecord.model_validate_json(line)
                self.records.append(record)
                for observe in self._observers:
                    observe(record)
        except BaseException as exc:  # handed to close(), which re-raises it on the loop's thread
            self._failure = exc
            self._process.stdout.close()


def main() -> None:
    for stop in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole group: it ends when its input ends
        signal.signal(stop, signal.SIG_IGN)
    os.nice(NICENESS)
    path = Path(sys.argv[1])
    try:
        appender = JsonlAppender(path)
        sys.stdout.buffer.write(READY)
        sys.stdout.buffer.flush()
        write_records(sys.stdin.buffer, appender, sys.stdout.buffer)
        appender.close()
    except OSError as exc:
        _give_up(path, exc)


def _give_up(path: Path, exc: OSError) -> None:
    """One line, the echo ended (the caller stops sending), the caller's frames read to their end so its writes
    never fail; `os._exit`, so the file's unwritten buffer is not tried again on the way out."""
    sys.stderr.write(f"{exc.filename or path}: {exc.strerror or exc}\n")
    sys.stderr.flush()
    os.close(sys.stdout.fileno())
    while os.read(sys.stdin.fileno(), PIPE_BYTES):
        pass
    os._exit(WRITE_FAILED)


if __name__ == "__main__":
    main()
