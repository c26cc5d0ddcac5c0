"""pytest plugin of a ``python -m bench gpu-tests`` shard (loaded with ``-p bench._shard_plugin``).

Appends one JSON line per event to the file named by ``TRITONMOE_SHARD_EVENTS``, flushed as it
happens, so the runner knows what a shard did even when it is killed or crashes mid-test:

* ``{"e": "start", "id": nodeid, "t": time}`` when a test starts;
* ``{"e": "report", "id", "when", "outcome", "dur", "xfail", "msg"}`` per phase (setup, call,
  teardown);
* ``{"e": "finish", "id"}`` when its teardown is over;
* ``{"e": "collect_error", "id", "msg"}`` for a file that failed to collect;
* ``{"e": "end", "rc"}`` at the end of the session.

Standard library only; without the variable it does nothing.
"""

from __future__ import annotations

import json
import os
import time

_PATH = os.environ.get("TRITONMOE_SHARD_EVENTS")
_FILE = None


def _emit(**event) -> None:
    global _FILE
    if not _PATH:
        return
    if _FILE is None:
        _FILE = open(_PATH, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the session)
    _FILE.write(json.dumps(event) + "\n")
    _FILE.flush()


def _message(report) -> str:
    """One line for a report: the crash message of a failure, the reason of a skip."""
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (path, line, reason)
        return str(lr[2])
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message).strip().splitlines()[0][:300] if str(crash.message).strip() else ""
    text = str(lr).strip().splitlines()
    return text[-1][:300] if text else ""


def pytest_runtest_logstart(nodeid, location):
    _emit(e="start", id=nodeid, t=time.time())


def pytest_runtest_logreport(report):
    _emit(e="report", id=report.nodeid, when=report.when, outcome=report.outcome, dur=float(report.duration),
          xfail=hasattr(report, "wasxfail"), msg=_message(report) if report.outcome != "passed" else "")


def pytest_runtest_logfinish(nodeid, location):
    _emit(e="finish", id=nodeid)


def pytest_collectreport(report):
    if report.failed:
        _emit(e="collect_error", id=report.nodeid, msg=_message(report))


def pytest_sessionfinish(session, exitstatus):
    _emit(e="end", rc=int(exitstatus))
