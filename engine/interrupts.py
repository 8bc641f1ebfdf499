"""Ctrl-C and `kill` for the commands that publish what they build (engine convert, pack-store): the signal is
raised as KeyboardInterrupt, so the staging directory unwinds, and it is also recorded, so that one Python drops
stops the publish all the same. Python drops an exception raised inside a destructor ("Exception ignored in
__del__"): a Ctrl-C landing while transformers' tokenizer conversion frees its regex objects was lost that way, and
`engine convert` went on to publish the model it was told to abandon.

    with interrupts.recorded():       # the command, in the main thread
        ... build in staging ...
        interrupts.check()            # the library, right before its rename
        publish()
"""
from __future__ import annotations

import contextlib
import signal
import threading

_seen = threading.Event()           # the one record: set by the handler, read by check()


def _raise(signum, frame):
    _seen.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def recorded():
    """SIGINT and SIGTERM raise KeyboardInterrupt and are remembered for the block; outside the main thread
    (signals cannot be handled there, e.g. under a test runner's thread) the block runs as it is."""
    _seen.clear()
    try:
        old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _seen.clear()


def check() -> None:
    """Before an irreversible step: KeyboardInterrupt if a signal came in the recorded block, even one dropped."""
    if _seen.is_set():
        raise KeyboardInterrupt
