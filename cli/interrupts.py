"""Ctrl-C and SIGTERM that end a sweep within seconds, even inside one long forward pass.

Python runs a signal's handler between bytecodes of the main thread, so a signal that arrives while torch
runs one operation of minutes (plain attention over 100k tokens on a CPU) waits for it: a probe's SIGTERM
was still unanswered 101 s later. The standard library has no timeout for that; its wakeup file
descriptor (``signal.set_wakeup_fd``) is written the moment a signal arrives, whatever the main thread
is doing, so a thread watching it can end the process when the main thread does not get to it in time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

GRACE_SECONDS = 5.0  # how long the main thread has to stop on its own (its summary line, its exit status)


@contextmanager
def prompt_interrupts(say: Callable[[], str], grace: float = GRACE_SECONDS) -> Iterator[None]:
    """Around work whose every result is already on disk when written (a sweep's appended records): after
    Ctrl-C or SIGTERM, the main thread's own handling if it comes within ``grace`` seconds, else the line
    ``say()`` returns on stderr and an exit with the status a shell reports for that signal (130, 143),
    without waiting for the operation in progress. Off the main thread, or where a wakeup descriptor is
    already set (an event loop's), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else's: theirs stays
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        yield
        return
    finished = threading.Event()

    def watch() -> None:
        got = b""
        while got[:1] not in (bytes([signal.SIGINT]), bytes([signal.SIGTERM])):
            got = os.read(read_end, 1)  # a byte per signal with a Python handler
            if finished.is_set() or not got:
                return
        if finished.wait(grace):
            return
        sys.stderr.write(f"\n{say()}\n")
        sys.stderr.flush()
        os._exit(128 + got[0])

    watcher = threading.Thread(target=watch, name="prompt-interrupts", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        signal.set_wakeup_fd(-1)
        os.write(write_end, b"\0")  # wakes the watcher, which sees the work finished
        watcher.join()
        os.close(read_end)
        os.close(write_end)


@contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM held off for the block (a session file being written on the way out: a Ctrl-C
    there lost the whole run's exchanges); yields a list that holds the signal that came, if one did, for
    the exit status after it. Off the main thread, nothing changes."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def hold(signum, frame) -> None:
        came[:] = [signum]

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield came
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
