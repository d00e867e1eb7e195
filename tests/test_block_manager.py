"""Host-side page bookkeeping: free list, reference counts, prefix matching with verification, LRU eviction."""

from jaxserve.engine.block_manager import SCRATCH_PAGE, BlockManager
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import SamplingParams


def make_seq(tokens, request_id="r"):
    return Sequence(request_id, 0, tokens, SamplingParams(), seed=0, arrival_time=0.0)


def run_to_completion(manager: BlockManager, seq: Sequence) -> None:
    manager.admit(seq, manager.match_prefix(seq))
    assert manager.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    manager.commit_full_pages(seq)


def test_scratch_page_never_allocated_and_counts_balance():
    manager = BlockManager(num_pages=5, page_size=4)
    seq = make_seq(list(range(16)))
    run_to_completion(manager, seq)
    assert SCRATCH_PAGE not in seq.page_table and len(seq.page_table) == 4
    assert manager.num_free_pages == 0
    assert not manager.allocate(make_seq([1]), 1)
    manager.free(seq)
    assert manager.num_free_pages == 4 and all(count == 0 for count in manager.ref_counts)


def test_prefix_hit_shares_pages_and_leaves_one_token_to_compute():
    manager = BlockManager(num_pages=16, page_size=4)
    first = make_seq(list(range(10)))
    run_to_completion(manager, first)
    second = make_seq(list(range(8)) + [99, 98])
    hit = manager.match_prefix(second)
    assert hit == first.page_table[:2]
    manager.admit(second, hit)
    assert second.num_computed_tokens == 8 and manager.ref_counts[hit[0]] == 2
    # a prompt that is entirely cached still leaves its last token to compute
    third = make_seq(list(range(8)))
    assert manager.match_prefix(third) == first.page_table[:1]
    assert manager.num_prefix_hits == 8 and manager.num_prefix_queries == 20  # both admissions looked up


def test_hash_collision_is_caught_by_token_verification():
    manager = BlockManager(num_pages=8, page_size=4)
    seq = make_seq(list(range(9)))
    run_to_completion(manager, seq)
    page = seq.page_table[0]
    manager.tokens_of_page[page] = (7, 7, 7, 7)  # as if a different prefix had the same hash
    assert manager.match_prefix(make_seq(list(range(9)))) == []


def test_freed_cached_pages_survive_until_evicted_tail_first():
    manager = BlockManager(num_pages=5, page_size=4)
    seq = make_seq(list(range(13)))
    run_to_completion(manager, seq)
    pages = list(seq.page_table)
    manager.free(seq)
    assert manager.match_prefix(make_seq(list(range(13)))) == pages[:3]
    # the unhashed partial page goes first, then the tail of the cached prefix
    other = make_seq([50, 51, 52])
    manager.admit(other, [])
    assert manager.allocate(other, 3) and other.page_table == [pages[3]]
    assert manager.allocate(other, 7) and other.page_table[1] == pages[2]
    assert manager.match_prefix(make_seq(list(range(13)))) == pages[:2]


def test_no_caching_when_disabled():
    manager = BlockManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(9)))
    run_to_completion(manager, seq)
    manager.free(seq)
    assert manager.match_prefix(make_seq(list(range(9)))) == []
