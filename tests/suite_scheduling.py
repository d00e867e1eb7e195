"""The suite's units of work under `--dist loadfile` (tests/run_suite.py): a test file runs whole on one worker, as
xdist does it, except that the files using conftest's `default_server` are one unit, so one worker starts that
server (a start is about half a minute of both cores' time) and the other never does.

xdist's own way, `--dist loadgroup` with `xdist_group` marks, renames each test's node id, which pytest 9 no longer
lets a plugin do (pytest-xdist 3.8 still tries, silently to no effect); the scheduler below groups by file name
instead. Workers check that every test using `default_server` is in one of these files."""

from __future__ import annotations

import pytest

from tests.suite_budget import file_of

DEFAULT_SERVER_FILES = ("tests/test_server.py", "tests/test_server_clients.py")


def unit_of(nodeid: str) -> str:
    """The unit `nodeid`'s test runs in: its file, or `default_server` for DEFAULT_SERVER_FILES."""
    path = file_of(nodeid)
    return "default_server" if path in DEFAULT_SERVER_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return SharedServerScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = sorted({file_of(item.nodeid) for item in items if "default_server" in item.fixturenames}
                    - set(DEFAULT_SERVER_FILES))
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use default_server: add them to "
                                f"tests/suite_scheduling.py's DEFAULT_SERVER_FILES")
