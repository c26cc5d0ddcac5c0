"""Per-test time limits without the pytest-timeout plugin (tests/conftest.py arms them).

A test marked ``@pytest.mark.timeout_s(N)``, and every ``gpu`` test (limit
:data:`GPU_TEST_TIMEOUT_S`, from ``TRITONMOE_GPU_TEST_TIMEOUT_S``, default 600 s), runs each of
its phases (setup, call, teardown) under :func:`time_limit`:

* after N seconds a ``SIGALRM`` raises :class:`TestTimeLimit` in the test's thread: the test
  fails with the phase and the limit, and the session goes on (Python-level waits: a join, a
  sleep, a subprocess, a collective that polls);
* if the process is stuck in native code that never returns to the interpreter (an NCCL
  teardown, a CUDA call), the alarm cannot be delivered to Python code: N + ``hard_grace_s``
  seconds in, faulthandler dumps every thread's stack and ends the process (the last resort;
  ``python -m bench gpu-tests`` then reruns the shard's remaining tests in a new shard).

Where ``SIGALRM`` is unavailable (not the main thread, not POSIX) only the hard limit applies.
Where pytest's own ``faulthandler_timeout`` is set (``python -m bench gpu-tests`` sets it, and
kills the shard of a test past its limit) the hard limit is left to it: faulthandler keeps one
timer per process, and pytest's dumps the stuck test's stacks into the shard's log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from typing import Iterator, Optional

#: The limit of every ``gpu`` test's phase (seconds).
GPU_TEST_TIMEOUT_S = float(os.environ.get("TRITONMOE_GPU_TEST_TIMEOUT_S", "600"))
#: How long past the soft limit a phase stuck in native code may run before the process ends.
HARD_GRACE_S = 30.0


class TestTimeLimit(Exception):
    """A test phase ran past its time limit (raised in the test by :func:`time_limit`)."""

    __test__ = False  # not a test class for pytest's collection


def limit_of(item) -> Optional[float]:
    """The time limit of a pytest item: its ``timeout_s`` marker's first argument, else
    :data:`GPU_TEST_TIMEOUT_S` for a ``gpu`` test, else None (no limit)."""
    mark = item.get_closest_marker("timeout_s")
    if mark is not None:
        if not mark.args or isinstance(mark.args[0], bool) or not isinstance(mark.args[0], (int, float)) \
                or mark.args[0] <= 0:
            raise ValueError(f"{item.nodeid}: @pytest.mark.timeout_s needs a positive number of seconds, "
                             f"got {mark.args!r}")
        return float(mark.args[0])
    if item.get_closest_marker("gpu") is not None:
        return GPU_TEST_TIMEOUT_S
    return None


@contextlib.contextmanager
def time_limit(seconds: Optional[float], what: str, *, hard_grace_s: Optional[float] = HARD_GRACE_S) -> Iterator[None]:
    """Run the body under a soft limit (``TestTimeLimit`` raised by ``SIGALRM``) and a hard one
    (faulthandler's stack dump and exit, ``hard_grace_s`` later; None: no hard limit, e.g. when
    pytest's own ``faulthandler_timeout`` is armed: faulthandler has one timer per process).
    ``seconds`` None: no limit."""
    if seconds is None:
        yield
        return
    soft = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    t0 = time.monotonic()
    previous = None
    if soft:
        def on_alarm(signum, frame):
            raise TestTimeLimit(f"{what} ran past its time limit of {seconds:g} s (after "
                                f"{time.monotonic() - t0:.1f} s); see tests/_timeouts.py")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    if hard_grace_s is not None:
        faulthandler.dump_traceback_later(seconds + hard_grace_s, exit=True)
    try:
        yield
    finally:
        if hard_grace_s is not None:
            faulthandler.cancel_dump_traceback_later()
        if soft:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
