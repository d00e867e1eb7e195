"""The suite's time budget (tests/suite_budget.py): the limits stretch with a slower machine, not with a file that
grew."""

from __future__ import annotations

import pytest

from tests.suite_budget import MAX_PACE, pace

RECORDED = {"tests/a.py": 100.0, "tests/b.py": 50.0}


def test_a_uniformly_slower_run_stretches_the_limits_by_its_pace():
    assert pace({"tests/a.py": 130.0, "tests/b.py": 65.0}, RECORDED) == pytest.approx(1.3)


def test_a_faster_run_keeps_the_limits_and_a_much_slower_one_stretches_them_at_most_max_pace():
    assert pace({"tests/a.py": 50.0, "tests/b.py": 20.0}, RECORDED) == 1.0
    assert pace({"tests/a.py": 500.0, "tests/b.py": 250.0}, RECORDED) == MAX_PACE


def test_one_file_that_grew_moves_the_pace_by_its_share_only_and_new_files_not_at_all():
    grown = pace({"tests/a.py": 100.0, "tests/b.py": 80.0, "tests/new.py": 900.0}, RECORDED)
    assert grown == pytest.approx(180 / 150)
    assert pace({"tests/new.py": 900.0}, RECORDED) == 1.0
