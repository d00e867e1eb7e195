"""Host-side page bookkeeping: free list, reference counts, exact prefix matching, LRU eviction."""

import hashlib

import numpy as np

from jaxserve.engine.page_manager import PageManager, page_key
from jaxserve.engine.page_pool import SCRATCH_PAGE
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import SamplingParams


def make_seq(tokens, request_id="r"):
    return Sequence(request_id, 0, tokens, SamplingParams(), seed=0, arrival_time=0.0)


def admit(manager: PageManager, seq: Sequence, pages: list[int]) -> None:
    """Admits `seq` onto `pages` as the scheduler does: the page manager's cached tokens become its counters."""
    seq.num_computed_tokens = seq.num_cached_tokens = manager.admit(seq, pages)


def run_to_completion(manager: PageManager, seq: Sequence) -> None:
    admit(manager, seq, manager.match_prefix(seq))
    assert manager.allocate(seq, len(seq))
    manager.record_lookup(seq, seq.num_cached_tokens, [])
    seq.num_computed_tokens = len(seq)
    manager.commit_full_pages(seq)


def test_scratch_page_never_allocated_and_counts_balance():
    manager = PageManager(num_pages=5, page_size=4)
    seq = make_seq(list(range(16)))
    run_to_completion(manager, seq)
    assert SCRATCH_PAGE not in manager.page_table(seq.seq_id) and len(manager.page_table(seq.seq_id)) == 4
    assert manager.num_free_pages == 0
    assert not manager.allocate(make_seq([1]), 1)
    manager.free(seq)
    assert manager.num_free_pages == 4 and all(count == 0 for count in manager.pool.ref_counts)


def test_prefix_hit_shares_pages_and_leaves_one_token_to_compute():
    manager = PageManager(num_pages=16, page_size=4)
    first = make_seq(list(range(10)))
    run_to_completion(manager, first)
    second = make_seq(list(range(8)) + [99, 98])
    hit = manager.match_prefix(second)
    assert hit == manager.page_table(first.seq_id)[:2]
    admit(manager, second, hit)
    manager.record_lookup(second, second.num_cached_tokens, [])
    assert second.num_computed_tokens == 8 and manager.pool.ref_counts[hit[0]] == 2
    # a prompt that is entirely cached still leaves its last token to compute
    third = make_seq(list(range(8)))
    assert manager.match_prefix(third) == manager.page_table(first.seq_id)[:1]
    assert manager.num_prefix_hits == 8 and manager.num_prefix_queries == 20  # both admissions looked up


def test_colliding_key_with_other_tokens_is_a_miss():
    # every page's key collides with every other's: only the token check can tell them apart
    manager = PageManager(num_pages=8, page_size=4, hash_fn=lambda parent, tokens: b"same")
    seq = make_seq(list(range(9)))
    run_to_completion(manager, seq)
    assert manager.match_prefix(make_seq([7, 7, 7, 7, 4])) == []
    assert manager.match_prefix(make_seq(list(range(9)))) == manager.page_table(seq.seq_id)[:1]


def test_parent_collision_is_a_miss():
    """A page whose key and tokens match but whose parent is another page's prefix is not reused (the
    pattern of vLLM's CVE-2025-25183): the key ignores the parent here, as a colliding hash would."""

    def ignores_parent(parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return page_key(b"", tokens)

    manager = PageManager(num_pages=16, page_size=4, hash_fn=ignores_parent)
    first = make_seq([1, 2, 3, 4] + [5, 6, 7, 8] + [0])  # pages X0, Y
    run_to_completion(manager, first)
    other = make_seq([9, 9, 9, 9] + [0])  # page X1, cached on its own
    run_to_completion(manager, other)
    # [X1, Y]: X1 is an exact hit; Y's key and tokens match first's second page, computed after X0
    probe = make_seq([9, 9, 9, 9] + [5, 6, 7, 8] + [0])
    assert manager.match_prefix(probe) == manager.page_table(other.seq_id)[:1]
    assert manager.match_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == manager.page_table(first.seq_id)[:2]


def test_keys_are_sha256_of_parent_key_and_tokens():
    key = page_key(b"", (1, 2, 3, 4))
    assert key == hashlib.sha256(b"" + bytes(np.asarray([1, 2, 3, 4], np.int64))).digest()
    assert page_key(key, (1, 2, 3, 4)) != key and len(key) == 32


def test_same_prefix_computed_twice_keeps_one_exact_chain():
    manager = PageManager(num_pages=16, page_size=4)
    tokens = list(range(12)) + [99]
    a, b = make_seq(tokens, "a"), make_seq(tokens, "b")
    for seq in (a, b):  # admitted together: neither hits, both compute the whole prompt
        admit(manager, seq, manager.match_prefix(seq))
        assert manager.allocate(seq, len(seq))
    for seq in (a, b):
        seq.num_computed_tokens = len(seq)
        manager.commit_full_pages(seq)
    assert len(manager.cached) == 3  # b's equal pages hold the same prefix: a's registrations stand for both
    assert manager.match_prefix(make_seq(tokens, "c")) == manager.page_table(a.seq_id)[:3]
    assert manager.match_prefix(make_seq(tokens)) == manager.page_table(a.seq_id)[:3]


def test_freed_cached_pages_survive_until_evicted_tail_first():
    manager = PageManager(num_pages=5, page_size=4)
    seq = make_seq(list(range(13)))
    run_to_completion(manager, seq)
    pages = list(manager.page_table(seq.seq_id))
    manager.free(seq)
    assert manager.match_prefix(make_seq(list(range(13)))) == pages[:3]
    # the unhashed partial page goes first, then the tail of the cached prefix
    other = make_seq([50, 51, 52])
    admit(manager, other, [])
    assert manager.allocate(other, 3) and manager.page_table(other.seq_id) == [pages[3]]
    assert manager.allocate(other, 7) and manager.page_table(other.seq_id)[1] == pages[2]
    assert manager.match_prefix(make_seq(list(range(13)))) == pages[:2]


def test_no_caching_when_disabled():
    manager = PageManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(9)))
    run_to_completion(manager, seq)
    manager.free(seq)
    assert manager.match_prefix(make_seq(list(range(9)))) == []
