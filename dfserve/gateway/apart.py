"""Observers in a process of their own: the gateway's configured observers (a capture, shadow records, kinds named
in `observers:`) run in a child process, so that their work (reading a stream's pieces into a record, JSON, writes)
neither runs on the event loop nor takes the GIL from it. In one process, an observer's thread took turns with the
loop for the GIL, and every hand-over cost the loop its warm caches: shadow records and a capture added 8% to the
loop's own CPU per chunk besides the threads' (bench/gateway_overhead.py). The loop's cost per exchange is now its
`marshal` (`Exchanged.wire`) into a buffer written to a pipe once per turn of the loop, as the load tester hands
what a request left to its writer process.

The child is forked, not spawned: observers are built in it from the gateway's own objects (`build`, called there;
a kind registered at run time works as one registered at import), and it is ready in milliseconds. It closes every
descriptor it inherited but its two pipes and stdio, ignores SIGINT, SIGTERM and SIGHUP (the gateway's stop closes
its pipe; so does a gateway that dies, and the child then observes what it was sent, closes its observers and
exits), and is niced. In it each observer has its thread and bounded queue as in the gateway (`observers._Lane`):
batches, the queue's bound and an observer's faults are as they were. What comes back goes on a second pipe, read
by a thread of the gateway's: faults, counted and logged once there, and calls an observer makes to the gateway
(`remote`: a live decision stopping the mirroring, setting its gauges). A building observer that raises is raised
in the gateway (`start`), a `FieldError` naming its field.

The pipe's buffer in the gateway is bounded (`BUFFER_BYTES`): an exchange that finds it full, or the child gone,
is dropped for every observer in the child and counted as `behind` for each, and an observer that counts its
misses (`Missing`) is told in the child, by a frame without the exchange's body and pieces.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import marshal
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from dfserve.errors import FieldError, UserError

log = logging.getLogger("dfserve.gateway")

Build = Callable[[], Any]
"""Builds an observer, in the child."""
Faults = Callable[[str, "BaseException | str | None"], None]

NICENESS = 10
"""The child yields the CPU to the gateway whenever both want it (a gateway pinned to one core)."""
PIPE_BYTES = 1 << 20
"""Linux's largest pipe for an unprivileged process (/proc/sys/fs/pipe-max-size); the default is 64 KiB."""
BUFFER_BYTES = 64 << 20
"""What the gateway holds for a child that reads slower than exchanges finish, beyond the pipe's own."""
LENGTH = 4
READ_PAUSE_S = 0.02
"""Between two reads of the child's pipe: what the pipe holds meanwhile is read at once (`read_batches`)."""
EXCHANGE, MISSED = 0, 1
"""Frames the gateway sends: an exchange (`Exchanged.wire`), or one dropped (its wire without body or pieces)."""


@dataclass(frozen=True)
class ApartObserver:
    """An observer to run in the child: its name (its `observer` label), how to build it, its queue's bound."""

    name: str
    build: Build
    queue_size: int


def frame(value: tuple[Any, ...]) -> bytes:
    data = marshal.dumps(value)
    return len(data).to_bytes(LENGTH, "little") + data


def _read_exact(fd: int, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = os.read(fd, min(left, PIPE_BYTES))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_batches(fd: int) -> Iterator[list[tuple[Any, ...]]]:
    """The frames that arrive on `fd`, a batch per read (a whole pipe's worth, at most), `READ_PAUSE_S` apart, so
    that the child wakes a few times a second rather than once per turn of the gateway's loop; ends at the end of
    the pipe (a frame cut short, its writer killed mid-write, is dropped)."""
    pending = bytearray()
    while data := os.read(fd, PIPE_BYTES):
        pending += data
        batch, start = [], 0
        with memoryview(pending) as view:
            while len(view) - start >= LENGTH:
                end = start + LENGTH + int.from_bytes(view[start:start + LENGTH], "little")
                if end > len(view):
                    break
                batch.append(marshal.loads(view[start + LENGTH:end]))
                start = end
        del pending[:start]
        yield batch
        time.sleep(READ_PAUSE_S)


def read_frame(fd: int) -> tuple[Any, ...] | None:
    """The next frame's value; None at the end, or at a frame cut short (the writer died mid-write)."""
    head = _read_exact(fd, LENGTH)
    if head is None:
        return None
    data = _read_exact(fd, int.from_bytes(head, "little"))
    return cast(tuple[Any, ...], marshal.loads(data)) if data is not None else None


class Remote:
    """Functions of the gateway an observer in the child calls (`ApartProcess.remote`): each call is a message to
    the gateway, which runs the function there, on its reading thread."""

    def __init__(self) -> None:
        self.functions: dict[int, Callable[..., None]] = {}
        self.send: Callable[[tuple[Any, ...]], None] | None = None
        """Set in the child: writes a message to the gateway."""
        self._ids = itertools.count()

    def __call__(self, function: Callable[..., None]) -> Callable[..., None]:
        key = next(self._ids)
        self.functions[key] = function

        def call(*args: Any) -> None:
            if self.send is None:  # not in the child: the gateway's own call
                function(*args)
            else:
                self.send(("call", key, args))
        return call


class ApartProcess:
    """The gateway's side: forks the child (`start`), writes each exchange's frame (`offer`, on the event loop),
    reads what comes back, and closes the child with the gateway (`close`)."""

    def __init__(self, observers: Sequence[ApartObserver], faults: dict[str, Faults], remote: Remote) -> None:
        self.observers = tuple(observers)
        self.faults = faults
        self.remote = remote
        self.pid: int | None = None
        self._fd = -1
        self._buffer = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._writing = False
        self._gone = False
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Fork the child and wait until its observers are built; what building one raised is raised here."""
        from_gateway, to_child = os.pipe()
        from_child, to_gateway = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            status = 1
            try:
                os.close(to_child)
                os.close(from_child)
                status = _child(self.observers, self.remote, from_gateway, to_gateway)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        os.close(from_gateway)
        os.close(to_gateway)
        self.pid, self._fd = pid, to_child
        while (message := read_frame(from_child)) is not None and message[:1] in (("fault",), ("call",)):
            self._dispatch(message)  # an observer may call the gateway as it is built
        if message is None or message[:1] != ("ready",):
            os.close(from_child)
            self._close_pipe()
            os.waitpid(pid, 0)
            raise _built_error(message)
        os.set_blocking(to_child, False)
        try:
            fcntl.fcntl(to_child, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe: the buffer holds the rest
        self._reader = threading.Thread(target=self._read, args=(from_child,), name="dfserve observers' process",
                                        daemon=True)
        self._reader.start()

    def offer(self, wire: tuple[Any, ...], light: Callable[[], tuple[Any, ...]]) -> None:
        """One exchange's `wire` to the child; dropped (and `light()` sent in its place) when the buffer is full.
        Called on one thread (the gateway's loop), as `seal` is."""
        if self._fd < 0:
            return  # sealed: the gateway is stopping
        if self._gone or len(self._buffer) > BUFFER_BYTES:
            for observer in self.observers:
                self.faults[observer.name]("behind", None)
            if not self._gone:
                self._buffer += frame((MISSED, light()))
            return
        try:
            self._buffer += frame((EXCHANGE, wire))
        except ValueError:  # a decoded body marshal cannot hold (nested too deep): the child decodes it again
            self._buffer += frame((EXCHANGE, (*wire[:-1], None)))
        if self._scheduled or self._writing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_all()  # not on a loop (a test's thread): written now
            return
        self._loop, self._scheduled = loop, True
        loop.call_soon(self._write)  # the loop's turn's exchanges in one write

    def _write(self) -> None:
        self._scheduled = False
        if self._fd < 0:
            return
        try:
            written = os.write(self._fd, self._buffer) if not self._gone else len(self._buffer)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self._ended(f"writing to it failed: {exc}")
            written = len(self._buffer)
        del self._buffer[:written]
        loop = self._loop
        if self._buffer and not self._writing and loop is not None:
            self._writing = True
            loop.add_writer(self._fd, self._write)
        elif not self._buffer and self._writing and loop is not None:
            self._writing = False
            loop.remove_writer(self._fd)

    def _write_all(self, timeout_s: float = 5.0) -> None:
        """Write the buffer out, waiting for the pipe (on a thread with no loop, or at the end)."""
        deadline = time.monotonic() + timeout_s
        while self._buffer and not self._gone:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                log.error("the observers' process read nothing for %g s; %d bytes of exchanges are dropped",
                          timeout_s, len(self._buffer))
                self._buffer.clear()
                return
            select.select([], [self._fd], [], left_s)
            try:
                written = os.write(self._fd, self._buffer)
            except BlockingIOError:
                continue
            except OSError as exc:
                self._ended(f"writing to it failed: {exc}")
                written = len(self._buffer)
            del self._buffer[:written]

    def _ended(self, why: str) -> None:
        """The child is gone before the gateway's stop (killed, or crashed): said once."""
        if not self._gone:
            self._gone = True
            log.error("the observers' process ended (%s); %s miss every later exchange, counted as behind", why,
                      ", ".join(o.name for o in self.observers))

    def _read(self, fd: int) -> None:
        """The gateway's thread reading the child's messages: faults, calls; it ends with the child."""
        try:
            while (message := read_frame(fd)) is not None:
                self._dispatch(message)
        finally:
            os.close(fd)
        if self._fd >= 0:  # not sealed: nobody asked it to end
            self._ended("its pipe closed")

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        if message[0] == "fault":
            _, name, reason, why = message
            self.faults[name](reason, why)
        elif message[0] == "call":
            _, key, args = message
            try:
                self.remote.functions[key](*args)
            except Exception:
                log.exception("an observer's call to the gateway failed")

    def _close_pipe(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def seal(self, timeout_s: float) -> None:
        """No more exchanges: what is buffered is written (waiting up to `timeout_s` for the child to read it) and the
        pipe closed, so the child observes the rest and ends. On the thread that offers (the gateway's loop)."""
        if self._fd < 0:
            return
        loop = self._loop
        if self._writing and loop is not None and not loop.is_closed():
            loop.remove_writer(self._fd)
        self._writing = self._scheduled = False
        self._write_all(timeout_s)
        self._close_pipe()

    def close(self, timeout_s: float) -> None:
        """`seal`, if the loop did not, then wait up to `timeout_s` for the child to observe everything it was sent
        and close its observers; a child still busy then is left to finish, said in one line."""
        self.seal(timeout_s)
        if self.pid is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.01)
        else:
            log.error("the observers' process did not finish within %g s of the gateway's stop; left to finish",
                      timeout_s)
            return
        if self._reader is not None:
            self._reader.join(timeout_s)
        self.pid = None


def _built_error(message: object) -> Exception:
    """What building the child's observers raised, as the gateway raises it."""
    if isinstance(message, tuple) and message[:1] == ("field",):
        _, field, text, other = message
        return FieldError(field, text, other)
    if isinstance(message, tuple) and message[:1] == ("user",):
        return UserError(message[1])
    if isinstance(message, tuple) and message[:1] == ("crash",):
        return RuntimeError(f"building the gateway's observers failed: {message[1]}")
    return RuntimeError("the observers' process ended before its observers were built")


def _child(observers: Sequence[ApartObserver], remote: Remote, source: int, sink: int) -> int:
    """The child's life: build every observer, say so, then hand each frame to each observer's lane until the
    gateway's end of the pipe closes; then let every lane finish and close."""
    from dfserve.gateway.observers import Exchanged, Lane, Missing

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    os.nice(NICENESS)
    keep = sorted({0, 1, 2, source, sink})
    for low, high in itertools.pairwise([*keep, _descriptor_limit()]):
        os.closerange(low + 1, high)
    sending = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        data = frame(message)
        with sending:
            os.write(sink, data)

    remote.send = send
    try:
        built = [(o, o.build()) for o in observers]
    except FieldError as exc:
        send(("field", exc.field, exc.message, exc.other))
        return 1
    except UserError as exc:
        send(("user", str(exc)))
        return 1
    except Exception as exc:
        send(("crash", f"{type(exc).__name__}: {exc}"))
        return 1

    def faults(name: str) -> Faults:
        def told(reason: str, why: BaseException | str | None) -> None:
            text = f"it raised {type(why).__name__}: {why}" if isinstance(why, BaseException) else why
            send(("fault", name, reason, text))
        return told

    lanes = [Lane(o.name, observer, o.queue_size, faults(o.name)) for o, observer in built]
    send(("ready",))
    for batch in read_batches(source):
        for kind, wire in batch:
            exchanged = Exchanged.from_wire(wire)
            for lane in lanes:
                if kind == EXCHANGE:
                    lane.offer(exchanged)
                elif isinstance(lane.observer, Missing):
                    lane.tell_missed(exchanged)
    for lane in lanes:
        lane.stop(timeout_s=30.0)
    return 0


def _descriptor_limit() -> int:
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 16
