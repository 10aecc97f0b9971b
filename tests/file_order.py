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
import os
import pathlib

import pytest

SECONDS_FILE = pathlib.Path(__file__).with_name("file_seconds.json")
REPO = SECONDS_FILE.parent.parent  # the json's names are relative to it, whatever the rootdir


def recorded_seconds() -> dict[str, float]:
    """The recorded seconds ({} without the file). Read once, by the process that starts the
    run (xdist's controller hands them to its workers): two workers that read two versions of
    the file would collect two orders, and xdist stops such a run."""
    try:
        seconds = json.loads(SECONDS_FILE.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as error:
        raise pytest.UsageError(f"{SECONDS_FILE}: {error} (fix or delete the file)") from None
    if not isinstance(seconds, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in seconds.values()
    ):
        raise pytest.UsageError(f"{SECONDS_FILE}: not an object of file names and seconds")
    return seconds


def id_file(nodeid: str) -> str:
    """The file part of a test id, relative to the rootdir as the id is."""
    return nodeid.split("::", 1)[0]


def file_of(nodeid: str, rootpath: pathlib.Path) -> str:
    """The file of a test id, relative to the repository (the json's names)."""
    return pathlib.Path(os.path.relpath(rootpath / id_file(nodeid), REPO)).as_posix()


def costliest_first(
    items: list[pytest.Item], unit_of, seconds: dict[str, float], rootpath: pathlib.Path
) -> None:
    """Sorts ``items`` in place by their unit's recorded ``seconds``, longest first; ``unit_of``
    maps a test id's file to its unit of work. A unit's items keep their order and stay together."""
    unit_seconds: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for index, name in enumerate(dict.fromkeys(id_file(item.nodeid) for item in items)):
        unit = unit_of(name)
        cost = seconds.get(file_of(name, rootpath), math.inf)
        unit_seconds[unit] = unit_seconds.get(unit, 0.0) + cost
        first_seen.setdefault(unit, index)

    def key(item):
        unit = unit_of(id_file(item.nodeid))
        return (-unit_seconds[unit], first_seen[unit])

    items.sort(key=key)


def refuse_partial_runs(config: pytest.Config) -> None:
    """Recording is for runs of whole files: a file's seconds from some of its tests would
    read as the whole file's and move it to the end of the queue."""
    option = config.option
    partial = [
        flag
        for flag, given in (
            ("-k", option.keyword),
            ("-m", option.markexpr),
            ("--deselect", getattr(option, "deselect", None)),
            ("--lf / --ff", getattr(option, "lf", False)),
            ("-x / --maxfail", option.maxfail),
            ("a test id", any("::" in arg for arg in config.args)),
        )
        if given
    ]
    if partial:
        raise pytest.UsageError(
            f"--record-file-seconds records whole files: run it without {', '.join(partial)}"
        )


class Recorder:
    """Sums each file's reported seconds (set-up, call and tear-down of every test) where the
    reports arrive (xdist's controller) and writes them when the run ends, over the recorded
    seconds of the files that did not run (a run of some files keeps the others'); a file
    that no longer exists is dropped. A worker's first file also carries its warm-up."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        name = file_of(report.nodeid, self.config.rootpath)
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            return
        merged = recorded_seconds() | self.seconds
        kept = {name: round(s, 1) for name, s in sorted(merged.items()) if (REPO / name).exists()}
        staged = SECONDS_FILE.with_suffix(".json.new")
        try:
            staged.write_text(json.dumps(kept, indent=1) + "\n")
            os.replace(staged, SECONDS_FILE)  # whole or not at all, for a run reading it now
        except OSError as error:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            reporter.write_line(f"--record-file-seconds: {SECONDS_FILE} not written: {error}")
