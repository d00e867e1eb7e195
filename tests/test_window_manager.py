"""The hybrid KV cache's host side (issue 29): the sliding-window layers' pages are released behind the window,
a sequence never holds more than a window and a step of them, and a prefix hit is only as long as the window
pool still holds what its next token's window reads."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import LayerSpec, ModelConfig
from jaxserve.distributed.tensor_parallel import TensorParallel
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_plan import SlidingWindowSpec, check_plan, plan_kv_cache, window_pages_per_seq
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.page_pool import SCRATCH_PAGE
from jaxserve.engine.window_manager import WindowManager
from jaxserve.layers.attention import make_attention_backend
from tests.test_page_manager import admit, make_seq

PAGE = 4
WINDOW = 6  # a query at p reads p - 5 .. p: pages (p - 5) // 4 on


def manager(window_pages: int = 40, full_pages: int = 40) -> PageManager:
    return PageManager(full_pages, PAGE, windows=(WindowManager(window_pages, PAGE, WINDOW),))


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
        window = pm.windows[0]
        table = window.tables[seq.seq_id]
        held = [table.pages[j] for j in range(table.start, len(table.pages))]
        assert table.start == window.first_needed(end) == max(0, end - WINDOW + 1) // PAGE
        assert all(window.pool.ref_counts[page] == 1 for page in held) and len(held) <= 3
        assert len(pm.page_table(seq.seq_id)) == len(table.pages) == -(-end // PAGE)  # the same indices, all full pages
    assert window.pool.num_free_pages == 39 - (len(table.pages) - table.start) == 37
    pm.free(seq)
    assert window.pool.num_free_pages == 39 and all(count == 0 for count in window.pool.ref_counts)
    assert seq.seq_id not in window.tables


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
    window = pm.windows[0]
    table = window.tables[again.seq_id]
    assert table.start == 4 and table.pages[:4] == [SCRATCH_PAGE] * 4
    assert all(window.pool.ref_counts[page] == 1 for page in table.pages[4:])
    pm.free(again)
    # evict window page 5 (the one a 24-token hit's window needs): the hit is shorter
    serial5 = pm.cached[hit[5]].serial
    window._forget(window.page_of[serial5])
    shorter = pm.match_prefix(make_seq(tokens))
    assert len(shorter) == 5  # 20 tokens: reads 15..20, pages 3 and 4
    window._forget(window.page_of[pm.cached[hit[3]].serial])
    assert len(pm.match_prefix(make_seq(tokens))) == 3  # 12 tokens: reads 7..12, pages 1 and 2


def test_allocation_fails_when_either_pool_is_short():
    pm = manager(window_pages=3, full_pages=40)  # two usable window pages
    seq = make_seq(list(range(40)))
    admit(pm, seq, [])
    assert pm.allocate(seq, 8)
    seq.num_computed_tokens = 8  # the next token (8) reads 3..8: page 0 still needed
    assert not pm.allocate(seq, 12) and len(pm.page_table(seq.seq_id)) == 2  # no third window page: nothing taken
    seq.num_computed_tokens = 9  # reads 4..9: page 0 fell behind and is released
    assert pm.allocate(seq, 12) and pm.windows[0].tables[seq.seq_id].start == 1 and len(pm.page_table(seq.seq_id)) == 3


def test_the_window_managers_changes_are_what_the_runner_lacks():
    """A window group's table reaches the runner as diffs: all of it at admission, then from the first index that
    changed (pages added, or trimmed away), nothing when nothing did."""
    pm = manager()
    seq = make_seq(list(range(40)))
    admit(pm, seq, [])
    assert pm.allocate(seq, 8)
    window = pm.windows[0]
    assert pm.window_changes(seq, new=True) == ((0, tuple(window.tables[seq.seq_id].pages)),)
    assert pm.window_changes(seq, new=False) == (None,)
    seq.num_computed_tokens = 8
    assert pm.allocate(seq, 16)  # pages 2 and 3 added
    pages = window.tables[seq.seq_id].pages
    assert pm.window_changes(seq, new=False) == ((2, (pages[2], pages[3])),)
    seq.token_ids = seq.token_ids[:9]
    pm.trim(seq)  # keeps 3 pages: page 3 released
    assert pm.window_changes(seq, new=False) == ((3, ()),) and len(window.tables[seq.seq_id].pages) == 3


def tiny_config(windows: tuple) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=len(windows), num_q_heads=2, num_kv_heads=1, head_dim=16,
                       layers=tuple(LayerSpec(sliding_window=window) for window in windows))


def test_the_plan_groups_layers_by_spec_and_sizes_each_pool():
    """Layers with equal specs share a group (group 0: the full-attention ones); without a budget each window group
    holds every slot's window and step, with one every group runs out together for sequences of max_model_len."""
    ec = EngineConfig(max_num_seqs=8, max_model_len=1024, page_size=16, max_num_batched_tokens=64)
    ec = ec.resolve(4096, "cpu")
    config = tiny_config((128, None, 128, 256, None))
    backend, tp = make_attention_backend("xla", None, "auto"), TensorParallel(1)
    layer_page = 2 * 16 * 1 * 16 * 4  # K and V, a page of 16 tokens, one head of 16 float32s
    plan = plan_kv_cache(config, ec, tp, backend, "float32", None)
    assert plan.layer_groups == (1, 0, 1, 2, 0)
    assert [g.layers for g in plan.groups] == [(1, 4), (0, 2), (3,)]
    assert plan.groups[1].spec == SlidingWindowSpec(1, 16, 128) and plan.groups[2].spec.window == 256
    assert [g.page_bytes for g in plan.groups] == [2 * layer_page, 2 * layer_page, layer_page]
    per_seq = [window_pages_per_seq(ec, window) for window in (128, 256)]
    assert per_seq[0] == -(-(127 + 64) // 16) + 1
    assert [g.num_pages for g in plan.groups] == [8 * 64 + 1, 8 * per_seq[0] + 1, 8 * per_seq[1] + 1]
    assert plan.layer_pages == [plan.groups[g].num_pages for g in plan.layer_groups]
    budget = 1_500_000  # about four sequences of max_model_len
    plan = plan_kv_cache(config, ec, tp, backend, "float32", budget)
    used = [(g.num_pages - 1) / pages for g, pages in zip(plan.groups, [64, *per_seq])]
    assert max(used) - min(used) < 0.1 and plan.pool_bytes <= budget  # they run out together
    plan = plan_kv_cache(config, ec, tp, backend, "float32", 10**8)  # a large one: windows stop at every slot's
    assert [g.num_pages for g in plan.groups[1:]] == [8 * per_seq[0] + 1, 8 * per_seq[1] + 1]
    one = plan_kv_cache(config, dataclasses.replace(ec, disable_hybrid_kv_cache_manager=True), tp, backend,
                        "float32", None)
    assert one.layer_groups == (0,) * 5 and len(one.groups) == 1  # the hybrid cache off: one group
    small = plan_kv_cache(config, ec, tp, backend, "float32", 20_000)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        check_plan(small, ec)
