"""The hybrid KV cache's host side (issue 29): the sliding-window layers' pages are released behind the window,
a sequence never holds more than a window and a step of them, and a prefix hit is only as long as the window
pool still holds what its next token's window reads."""

from __future__ import annotations

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_budget import hybrid_pages, window_pages_per_seq
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.window_pages import SCRATCH_PAGE, WindowPages
from tests.test_page_manager import admit, make_seq

PAGE = 4
WINDOW = 6  # a query at p reads p - 5 .. p: pages (p - 5) // 4 on


def manager(window_pages: int = 40, full_pages: int = 40) -> PageManager:
    return PageManager(full_pages, PAGE, window=WindowPages(window_pages, PAGE, WINDOW))


def advance(pm: PageManager, seq, to: int, step: int = 4) -> None:
    """Computes `seq` step by step (chunks of `step` tokens) up to `to` tokens, as the scheduler does."""
    while seq.num_computed_tokens < to:
        end = min(to, seq.num_computed_tokens + step)
        assert pm.allocate(seq, end)
        seq.num_computed_tokens = end
        pm.commit_full_pages(seq)


def test_pages_behind_the_window_are_released_and_the_rest_kept():
    pm = manager()
    seq = make_seq(list(range(40)))
    admit(pm, seq, [])
    for end in range(4, 41, 4):
        advance(pm, seq, end)
        pm.allocate(seq, end)  # the next step's allocation releases what fell behind
        window = pm.window
        held = [seq.window_pages[j] for j in range(seq.window_start, len(seq.window_pages))]
        assert seq.window_start == window.first_needed(end) == max(0, end - WINDOW + 1) // PAGE
        assert all(window.ref_counts[page] == 1 for page in held) and len(held) <= 3
        assert len(seq.page_table) == len(seq.window_pages) == -(-end // PAGE)  # the same indices, all full pages
    assert pm.window.num_free_pages == 39 - (len(seq.window_pages) - seq.window_start) == 37
    pm.free(seq)
    assert pm.window.num_free_pages == 39 and all(count == 0 for count in pm.window.ref_counts)


def test_a_prefix_hit_needs_the_window_pages_its_next_token_reads():
    pm = manager()
    tokens = list(range(100, 125))  # 6 full pages and a token
    first = make_seq(tokens)
    admit(pm, first, pm.match_prefix(first))
    advance(pm, first, len(tokens))
    pm.free(first)  # its pages stay cached: full pages 0-5 and window pages 0-5 (each registered when it filled)
    again = make_seq(tokens)
    hit = pm.match_prefix(again)
    assert len(hit) == 6  # 24 tokens: the next token (24) reads 19..24, window pages 4 and 5, both cached
    admit(pm, again, hit)
    assert again.window_start == 4 and again.window_pages[:4] == [SCRATCH_PAGE] * 4
    assert all(pm.window.ref_counts[page] == 1 for page in again.window_pages[4:])
    pm.free(again)
    # evict window page 5 (the one a 24-token hit's window needs): the hit is shorter
    serial5 = pm.cached[hit[5]].serial
    pm.window._forget(pm.window.page_of[serial5])
    shorter = pm.match_prefix(make_seq(tokens))
    assert len(shorter) == 5  # 20 tokens: reads 15..20, pages 3 and 4
    pm.window._forget(pm.window.page_of[pm.cached[hit[3]].serial])
    assert len(pm.match_prefix(make_seq(tokens))) == 3  # 12 tokens: reads 7..12, pages 1 and 2


def test_allocation_fails_when_either_pool_is_short():
    pm = manager(window_pages=3, full_pages=40)  # two usable window pages
    seq = make_seq(list(range(40)))
    admit(pm, seq, [])
    assert pm.allocate(seq, 8)
    seq.num_computed_tokens = 8  # the next token (8) reads 3..8: page 0 still needed
    assert not pm.allocate(seq, 12) and len(seq.page_table) == 2  # no third window page: nothing taken
    seq.num_computed_tokens = 9  # reads 4..9: page 0 fell behind and is released
    assert pm.allocate(seq, 12) and seq.window_start == 1 and len(seq.page_table) == 3


def test_pool_sizes_for_a_budget_run_out_together_and_fit_every_window():
    ec = EngineConfig(max_num_seqs=8, max_model_len=1024, page_size=16, max_num_batched_tokens=64)
    ec = ec.resolve(4096, "cpu")
    per_seq = window_pages_per_seq(ec, 128)
    assert per_seq == -(-(127 + 64) // 16) + 1
    full, window = hybrid_pages(ec, 128, None, 1000, 300)  # no budget: every slot's window
    assert window == 8 * per_seq + 1 and full == 8 * 64 + 1
    full, window = hybrid_pages(ec, 128, 10**5, 1000, 300)  # a budget: both run out at about the same count
    assert abs((full - 1) / 64 - (window - 1) / per_seq) < 0.1 and full * 1000 + window * 300 <= 10**5
    full, window = hybrid_pages(ec, 128, 10**6, 1000, 300)  # a large one: the window pool stops at every slot's
    assert window == 8 * per_seq + 1 and full == (10**6 - window * 300) // 1000
