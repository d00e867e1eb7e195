"""The suite's time budget: a pytest plugin that tests/run_suite.py loads (`-p suite_budget`). In the controlling
process it adds up each test's setup, call and teardown time per test and per file, and at the end prints the suite's
wall time, the slowest tests, every file's total and when each worker finished (the idle tail); it fails the run when a
file's tests together take longer than FILE_BUDGET_S, unless ALLOWED names the file with a reason and a larger limit.
The limits are for the machine that recorded tests/suite_durations.json; on a slower one they stretch by the run's
pace (the files' seconds over their recorded seconds, at most MAX_PACE), so a file fails for growing against the
others, not for a slower machine. `--suite-durations PATH` also writes the files' totals as JSON, which
tests/suite_durations.json keeps for run_suite's ordering. Inside xdist's workers it does nothing.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

FILE_BUDGET_S = 180.0
# file: (its limit in seconds, why it needs more than FILE_BUDGET_S)
# (each measured in a clean clone's `make test` at 5ded01a, docs/testing.md; the limits leave room for a slower run)
ALLOWED: dict[str, tuple[float, str]] = {
    "tests/test_compile_targets.py": (480.0, "282 s: each family compiled for a TPU and a GPU target, and the "
                                             "multi-device targets, by compilers whose executables jax's "
                                             "persistent cache cannot hold"),
    "tests/test_benchmarks.py": (260.0, "157 s: every benchmark script end to end, each its own process"),
    "tests/test_server.py": (300.0, "237 s: the default model's server starts here (97 s) for it and "
                                    "test_server_clients (tests/suite_scheduling.py)"),
    "tests/test_qwen3_next.py": (240.0, "160 s (at 5834ccb, a run ~20% slower throughout): three hybrid families "
                                        "against transformers, their steps compiled for v6e-1 and h200, and a "
                                        "subprocess starting split engines and replicas after other engines "
                                        "(issue 68; ~80 s of it since)"),
    "tests/test_multihost.py": (330.0, "262 s (four tests then, three now): three host processes per test, each "
                                       "starting jax and compiling, and a rank that starts 31 s late on purpose"),
}
SLOWEST = 60
RECORDED = Path(__file__).with_name("suite_durations.json")
MAX_PACE = 1.5  # CI's machine ran the suite 1.28 times as long as the recording one (docs/testing.md)


def pace(files: dict[str, float], recorded: dict[str, float]) -> float:
    """How much slower this run went than the recorded one, over the files both have: 1 to MAX_PACE."""
    common = [name for name in files if recorded.get(name, 0) > 0]
    before = sum(recorded[name] for name in common)
    return min(MAX_PACE, max(1.0, sum(files[name] for name in common) / before)) if before else 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-durations", default=None, metavar="PATH",
                     help="write each test file's total seconds to PATH (JSON)")
    parser.addoption("--suite-budget", default="on", choices=("on", "off"),
                     help="fail test files over their time budget (off: only report)")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(SuiteBudget(config), "suite_budget_report")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def test_id(nodeid: str) -> str:
    """`nodeid` without the `@group` xdist's loadgroup appends."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group else nodeid


class SuiteBudget:
    """What the controller hears of each test, and the report made of it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)
        self.file_worker: dict[str, str] = {}
        self.workers_down: dict[str, float] = {}
        self.over: list[tuple[str, float, float]] = []
        self.pace = 1.0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[test_id(report.nodeid)] += report.duration
        node = getattr(report, "node", None)
        if node is not None:
            self.file_worker[file_of(report.nodeid)] = node.gateway.id

    @property
    def files(self) -> dict[str, float]:
        """Each file's tests' seconds together."""
        totals: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.tests.items():
            totals[file_of(nodeid)] += seconds
        return totals

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.workers_down[node.gateway.id] = time.monotonic() - self.started

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        files = self.files
        path = self.config.getoption("suite_durations")
        if path:
            with open(path, "w") as out:
                json.dump({name: round(seconds, 1) for name, seconds in sorted(files.items())}, out, indent=1)
        self.pace = pace(files, json.loads(RECORDED.read_text()))
        for name, seconds in files.items():
            limit = self.limit(name)
            if seconds > limit:
                self.over.append((name, seconds, limit))
        if self.over and self.config.getoption("suite_budget") == "on" and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def limit(self, name: str) -> float:
        return ALLOWED.get(name, (FILE_BUDGET_S, ""))[0] * self.pace

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write, files = terminalreporter.write_line, self.files
        terminalreporter.section("suite time")
        write(f"wall {time.monotonic() - self.started:.0f} s; tests together {sum(self.tests.values()):.0f} s; "
              f"pace {self.pace:.2f} of tests/suite_durations.json's run (the budgets stretch by it)")
        for worker, at in sorted(self.workers_down.items()):
            busy = sum(s for name, s in files.items() if self.file_worker.get(name) == worker)
            write(f"worker {worker}: done at {at:.0f} s, tests {busy:.0f} s")
        write(f"slowest {SLOWEST} tests (setup + call + teardown):")
        for nodeid, seconds in sorted(self.tests.items(), key=lambda item: -item[1])[:SLOWEST]:
            write(f"  {seconds:7.1f} s  {nodeid}")
        write("files:")
        for name, seconds in sorted(files.items(), key=lambda item: -item[1]):
            limit = self.limit(name)
            write(f"  {seconds:7.1f} s  {name}  [{self.file_worker.get(name, '-')}]"
                  + ("  OVER ITS BUDGET" if seconds > limit else ""))
        for name, seconds, limit in self.over:
            terminalreporter.write_line(
                f"{name}: its tests took {seconds:.0f} s together, over its budget of {limit:.0f} s "
                f"(at pace {self.pace:.2f}) "
                f"(tests/suite_budget.py): make them smaller, or allow it there with a reason", red=True)
