"""The order in which `make test`'s two workers take the test files: the costliest first.

``--dist loadfile`` hands out whole files (tests/distributed as one unit, conftest.py) from a
queue. xdist orders that queue by each file's number of tests, which put the files of a few
long tests last: in one cold run a worker ran alone for the last 32 s (a 27 s file of fuzzing
tests began near the end). Taken longest first, the last units are short and both workers end
together.

The cost of a unit is its files' seconds in a recorded run, ``file_seconds.json`` beside this
file (written by ``make test PYTEST_ARGS=--record-file-seconds``). A file that is not in it
goes first, as the one whose cost is unknown. The order is only a schedule: every file still
runs, and its tests in their own order.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

SECONDS_FILE = pathlib.Path(__file__).with_name("file_seconds.json")


def recorded_seconds() -> dict[str, float]:
    try:
        return json.loads(SECONDS_FILE.read_text())
    except FileNotFoundError:
        return {}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def costliest_first(items: list[pytest.Item], unit_of) -> None:
    """Sorts ``items`` in place by their unit's recorded seconds, longest first; ``unit_of``
    maps a file to its unit of work. A unit's items keep their order and stay together."""
    seconds = recorded_seconds()
    unit_seconds: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for index, name in enumerate(dict.fromkeys(file_of(item.nodeid) for item in items)):
        unit = unit_of(name)
        unit_seconds[unit] = unit_seconds.get(unit, 0.0) + seconds.get(name, math.inf)
        first_seen.setdefault(unit, index)

    def key(item):
        unit = unit_of(file_of(item.nodeid))
        return (-unit_seconds[unit], first_seen[unit])

    items.sort(key=key)


class Recorder:
    """Sums each file's reported seconds (set-up, call and tear-down of every test) where the
    reports arrive (xdist's controller) and writes them when the run ends, over the recorded
    seconds of the files that did not run (a run of some files keeps the others'); a file
    that no longer exists is dropped."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        name = file_of(report.nodeid)
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session) -> None:
        merged = recorded_seconds() | self.seconds
        root = session.config.rootpath
        kept = {name: round(s, 1) for name, s in sorted(merged.items()) if (root / name).exists()}
        SECONDS_FILE.write_text(json.dumps(kept, indent=1) + "\n")
