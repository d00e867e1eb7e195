"""Scheduling for latency targets (`--scheduling-policy slo`) and vLLM's long-prefill limits, on the scheduler with
a fake clock: slack order, the aging bound, decode protection, the preemption victim, the chunk caps and shares,
and the options' checks. Engine-level: outputs do not depend on the policy, and goodput is counted."""

from __future__ import annotations

import math

import pytest

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_output import SampledToken
from jaxserve.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(policy: str = "slo", num_pages: int = 200, max_num_seqs: int = 8, **options) -> tuple[Scheduler,
                                                                                                        Clock]:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256, page_size=8, max_num_batched_tokens=64,
                          scheduling_policy=policy, **options).resolve(256)
    assert config.prefill_buckets == (16, 32, 64)
    clock = Clock()
    manager = PageManager(num_pages=num_pages, page_size=8, enable_prefix_caching=False)
    return Scheduler(config, manager, clock=clock), clock


def add(scheduler: Scheduler, prompt_len: int, name: str, arrival: float, ttft: float | None = None,
        tpot: float | None = None, max_tokens: int = 16) -> Sequence:
    seq = Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=0,
                   arrival_time=arrival)
    seq.ttft_slo, seq.tpot_slo = ttft, tpot
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, clock: Clock, seconds: float = 0.0) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Plans a step, runs it for `seconds` of the fake clock and reads it as the engine does. Returns its chunks as
    (request, start, tokens) and its decodes by request."""
    plan = scheduler.schedule()
    seqs = scheduler.seqs
    chunks = [(seqs[c.seq_id].request_id, c.start, c.num_tokens) for c in plan.prefills]
    decodes = [seqs[d.seq_id].request_id for d in plan.decodes]
    scheduler.update_after_dispatch(plan)
    clock.now += seconds
    sampled = [SampledToken(c.seq_id, 7) for c in plan.prefills if c.is_final]
    scheduler.update_from_output(sampled + [SampledToken(d.seq_id, 7) for d in plan.decodes])
    return chunks, decodes


def test_a_short_request_near_its_deadline_goes_before_a_long_one_with_time():
    for policy, first in (("fcfs", "long"), ("slo", "short")):
        scheduler, clock = make_scheduler(policy)
        if scheduler.slo is not None:
            scheduler.slo.costs.per_prefill_token = 0.001
        add(scheduler, 200, "long", arrival=0.0, ttft=30.0)
        step(scheduler, clock, 0.1)  # the long prompt is prefilling
        add(scheduler, 60, "short", arrival=0.1, ttft=0.5)
        chunks, _ = step(scheduler, clock)
        assert chunks[0][0] == first, policy
        # slo: the short prompt's whole 60 tokens (bucket 64) take the budget; fcfs: the long chunk does
        assert chunks == ([("long", 64, 64)] if policy == "fcfs" else [("short", 0, 60)])


def test_a_request_past_its_target_is_served_behind_those_that_can_make_theirs():
    scheduler, clock = make_scheduler()
    scheduler.slo.costs.per_prefill_token = 0.001
    clock.now = 5.0
    add(scheduler, 60, "late", arrival=1.0, ttft=1.0)  # its deadline (2.0) has passed
    add(scheduler, 60, "none", arrival=2.0)  # no target: best effort too, after the late one by arrival
    add(scheduler, 60, "on-time", arrival=4.0, ttft=2.0)
    order = [step(scheduler, clock, 0.1)[0][0][0] for _ in range(3)]
    assert order == ["on-time", "late", "none"]


def test_among_the_late_a_short_request_goes_before_a_long_one_that_arrived_first():
    scheduler, clock = make_scheduler()
    scheduler.slo.costs.seed({}, 0.001)
    clock.now = 1.0
    add(scheduler, 200, "long", arrival=0.0, ttft=0.1)  # 200 ms of prefill: never within its 100 ms target
    add(scheduler, 30, "short", arrival=0.5, ttft=0.1)  # late too, and by arrival after the long one
    assert step(scheduler, clock)[0][0] == ("short", 0, 30)


def test_no_request_waits_past_the_bound_under_a_stream_of_short_ones():
    """Every step brings two short requests with tight targets, which fill the budget; a long request with a loose
    target still gets its first chunk at the first step after it has waited slo_max_wait_ms, and not later."""
    scheduler, clock = make_scheduler(slo_max_wait_ms=1000.0)
    scheduler.slo.costs.per_prefill_token = 0.001
    add(scheduler, 200, "long", arrival=0.0, ttft=60.0)
    first_chunk_at, index = None, 0
    while first_chunk_at is None and clock.now < 3.0:
        for _ in range(2):
            add(scheduler, 30, f"short{index}", arrival=clock.now, ttft=0.3, max_tokens=1)
            index += 1
        at = clock.now
        chunks, _ = step(scheduler, clock, 0.1)
        if any(name == "long" for name, _, _ in chunks):
            first_chunk_at = at
    assert first_chunk_at is not None and 1.0 <= first_chunk_at < 1.0 + 0.1 + 1e-9
    # without the bound the stream would hold it back: with a bound longer than the run it never starts
    scheduler, clock = make_scheduler(slo_max_wait_ms=1e6)
    scheduler.slo.costs.per_prefill_token = 0.001
    add(scheduler, 200, "long", arrival=0.0, ttft=60.0)
    for index in range(20):
        for k in range(2):
            add(scheduler, 30, f"s{index}-{k}", arrival=clock.now, ttft=0.3, max_tokens=1)
        chunks, _ = step(scheduler, clock, 0.1)
        assert all(name != "long" for name, _, _ in chunks)


def test_decode_protection_holds_new_prefills_while_a_decode_would_miss_its_tpot():
    scheduler, clock = make_scheduler()
    costs = scheduler.slo.costs
    add(scheduler, 10, "decoding", arrival=0.0, tpot=0.05, max_tokens=100)
    step(scheduler, clock, 0.01)  # prefilled: its first token read at t = 0.01
    for _ in range(4):
        step(scheduler, clock, 0.01)  # decodes at 10 ms a step build up room: 5 tokens, 40 ms used of 250
    costs.per_prefill_token, costs._decode = 0.02, {1: 0.01}  # a 16-token chunk costs 320 ms: too much
    add(scheduler, 16, "new", arrival=clock.now, ttft=10.0)
    chunks, decodes = step(scheduler, clock, 0.01)
    assert decodes == ["decoding"] and chunks == []
    costs.per_prefill_token = 0.01  # a 16-token chunk (160 ms) fits the room left (300 - 60 - 10 ms)
    chunks, _ = step(scheduler, clock, 0.01)
    assert chunks == [("new", 0, 16)]


def test_decode_protection_leaves_a_step_within_the_tpot_target_when_decodes_have_no_room():
    """Decodes behind their TPOT target have no room to give, but a step may still take the target: new prefills
    get what the decodes leave of it, so a short request starts at once instead of at the aging bound."""
    scheduler, clock = make_scheduler()
    costs = scheduler.slo.costs
    add(scheduler, 10, "decoding", arrival=0.0, tpot=0.05, max_tokens=100)
    for _ in range(5):
        step(scheduler, clock, 0.06)  # 60 ms a token against its 50 ms target: no room
    costs.per_prefill_token, costs._decode = 0.002, {1: 0.01}  # 40 ms left of the target: 20 tokens, 16 fit
    add(scheduler, 30, "new", arrival=clock.now, ttft=10.0)
    assert step(scheduler, clock, 0.05)[0] == [("new", 0, 16)]
    add(scheduler, 30, "newer", arrival=clock.now, ttft=10.0)
    assert step(scheduler, clock, 0.05)[0] == [("new", 16, 14)]  # a running prefill goes on; 4 tokens left
    assert step(scheduler, clock, 0.05)[0] == [("newer", 0, 16)]


def test_a_running_prefill_past_the_bound_does_not_take_the_decodes_room_before_a_short_request():
    """The bound orders admissions; a running prefill is never held, so a long one past the bound goes after a
    short request that can still make its target and the short one gets the room the decodes leave whole."""
    scheduler, clock = make_scheduler(ttft_slo_ms=100.0, slo_max_wait_ms=200.0)
    costs = scheduler.slo.costs
    add(scheduler, 10, "decoding", arrival=0.0, tpot=0.05, max_tokens=100)
    add(scheduler, 200, "long", arrival=0.0)
    for _ in range(5):
        step(scheduler, clock, 0.06)  # the decode falls behind its target; the long prompt prefills 16 a step
    costs.per_prefill_token, costs._decode = 0.001, {1: 0.01}  # 40 tokens fit the step's 50 ms target
    add(scheduler, 30, "short", arrival=clock.now, ttft=0.1)
    assert step(scheduler, clock, 0.06)[0] == [("short", 0, 30), ("long", 96, 16)]


def test_decode_protection_does_not_hold_back_a_due_request():
    scheduler, clock = make_scheduler(slo_max_wait_ms=500.0)
    costs = scheduler.slo.costs
    add(scheduler, 10, "decoding", arrival=0.0, tpot=0.05, max_tokens=100)
    step(scheduler, clock, 0.01)
    costs.per_prefill_token, costs._decode = 1.0, {1: 0.01}  # any prefill would break the decode's target
    add(scheduler, 16, "waiting", arrival=0.0, ttft=100.0)
    held = [step(scheduler, clock, 0.1)[0] for _ in range(5)]  # at 0.01, 0.11, ..., 0.41 s
    assert held == [[]] * 5
    chunks, _ = step(scheduler, clock, 0.1)  # waited 0.51 s: due, so admitted whatever the decode's room
    assert chunks == [("waiting", 0, 16)]


def test_preemption_picks_the_sequence_with_the_most_slack():
    """Three 16-token prompts fill a pool of 6 pages; each decode needs a third page. fcfs preempts the newest,
    slo the one with the most slack (here the one without a target)."""
    for policy, victim in (("fcfs", "c"), ("slo", "b")):
        scheduler, clock = make_scheduler(policy, num_pages=7)
        for name, tpot in (("a", 0.1), ("b", None), ("c", 0.1)):
            add(scheduler, 16, name, arrival=0.0, ttft=10.0, tpot=tpot)
        chunks, _ = step(scheduler, clock, 0.01)
        assert len(chunks) == 3
        _, decodes = step(scheduler, clock, 0.01)
        assert sorted(decodes) == sorted({"a", "b", "c"} - {victim}), policy
        assert [seq.request_id for seq in scheduler.waiting] == [victim]
        assert scheduler.num_preemptions == 1


def test_a_sequence_admitted_and_preempted_in_one_step_is_not_sent_as_admitted():
    """Under slo a later running prefill may need the pages of a sequence admitted earlier in the same step (it has
    the most slack): the step must not hand the runner that admission, slotless."""
    scheduler, clock = make_scheduler(num_pages=9, long_prefill_token_threshold=32)  # 8 usable pages
    scheduler.slo.costs.per_prefill_token = 0.001
    add(scheduler, 64, "late", arrival=0.0, ttft=0.05)
    assert step(scheduler, clock, 1.0)[0] == [("late", 0, 32)]  # 4 pages; now past its target
    add(scheduler, 24, "on-time", arrival=clock.now, ttft=10.0)  # goes first, 3 pages
    plan = scheduler.schedule()
    assert all(new.slot is not None for new in plan.new_seqs) and not plan.new_seqs
    assert [scheduler.seqs[c.seq_id].request_id for c in plan.prefills] == ["late"]
    assert [seq.request_id for seq in scheduler.waiting] == ["on-time"] and scheduler.num_preemptions == 1


def test_the_long_prefill_threshold_caps_every_chunk_under_fcfs():
    scheduler, clock = make_scheduler("fcfs", long_prefill_token_threshold=40)
    add(scheduler, 100, "long", arrival=0.0)
    add(scheduler, 10, "short", arrival=0.0)
    chunks, _ = step(scheduler, clock)
    # 40 is no bucket: the long prompt's chunk is the largest bucket within it (32); the short one shares the step
    assert chunks == [("long", 0, 32), ("short", 0, 10)]
    chunks, _ = step(scheduler, clock)
    assert chunks == [("long", 32, 32)]


def test_partial_prefills_share_the_budget_and_long_ones_are_limited():
    scheduler, clock = make_scheduler("fcfs", long_prefill_token_threshold=48, max_num_partial_prefills=2,
                                      max_long_partial_prefills=1)
    add(scheduler, 100, "long1", arrival=0.0)
    add(scheduler, 100, "long2", arrival=0.0)
    add(scheduler, 40, "short", arrival=0.0)
    chunks, _ = step(scheduler, clock)
    # two prefills share 64 tokens (32 each); the second long prompt waits while one long prompt is prefilling,
    # so the short one goes past it
    assert chunks == [("long1", 0, 32), ("short", 0, 32)]
    chunks, _ = step(scheduler, clock)
    assert chunks == [("long1", 32, 32), ("short", 32, 8)]
    chunks, _ = step(scheduler, clock)
    # long1 has 36 tokens left, under the threshold: no longer long, so long2 starts
    assert chunks == [("long1", 64, 32), ("long2", 0, 32)]


def test_step_costs_are_measured_from_the_steps():
    scheduler, clock = make_scheduler()
    costs = scheduler.slo.costs
    add(scheduler, 64, "a", arrival=0.0)
    step(scheduler, clock, 0.5)  # 64 prefill tokens in 0.5 s
    assert costs.per_prefill_token == pytest.approx(0.5 / 64)
    step(scheduler, clock, 0.02)  # one decode
    assert costs.decode_seconds(1) == pytest.approx(0.02)
    assert costs.estimate(1, 64) == pytest.approx(0.52)
    costs.seed({1: 0.02}, 0.5 / 64)  # steps take half again as long (a busier host): mixed steps scale both costs
    for _ in range(40):
        costs.observe(1, 64, 0.52 * 1.5)
    assert costs.decode_seconds(1) == pytest.approx(0.03, rel=1e-3)
    assert costs.per_prefill_token == pytest.approx(0.75 / 64, rel=1e-3)


def test_slo_chunks_long_prefills_by_the_targets_without_a_threshold_and_fcfs_does_not():
    """No --long-prefill-token-threshold: under slo a running long prompt's chunk fits half the server's TTFT target
    at the measured cost (1 ms a token, 64 ms: 32 tokens), and a short request arriving meanwhile is admitted in the
    next step beside the next chunk; fcfs keeps vLLM's behaviour (the whole budget, the short one waits)."""
    expected = {"fcfs": ([("long", 0, 64)], [("long", 64, 64)]),
                "slo": ([("long", 0, 32)], [("short", 0, 20), ("long", 32, 32)])}
    for policy, (first, second) in expected.items():
        scheduler, clock = make_scheduler(policy, ttft_slo_ms=64.0)
        if scheduler.slo is not None:
            scheduler.slo.costs.seed({}, 0.001)
        add(scheduler, 200, "long", arrival=0.0, ttft=0.064)
        assert step(scheduler, clock, 0.032)[0] == first, policy
        add(scheduler, 20, "short", arrival=clock.now, ttft=0.064)
        assert step(scheduler, clock, 0.032)[0] == second, policy


def test_slo_long_prefills_share_the_step_threshold_unless_one_is_set():
    for options, first in (({}, [("long1", 0, 32)]),
                           (dict(long_prefill_token_threshold=32), [("long1", 0, 32), ("long2", 0, 32)])):
        scheduler, clock = make_scheduler(ttft_slo_ms=64.0, **options)
        scheduler.slo.costs.seed({}, 0.001)
        add(scheduler, 200, "long1", arrival=0.0)
        add(scheduler, 200, "long2", arrival=0.0)
        assert step(scheduler, clock, 0.032)[0] == first, options


def test_a_short_request_longer_than_the_step_threshold_is_no_long_prefill():
    """A due long prompt takes the step's long-prefill tokens first; a short request (its prefill well within its
    target) with more tokens than the threshold still gets its whole chunk beside it."""
    scheduler, clock = make_scheduler(ttft_slo_ms=100.0, slo_max_wait_ms=1.0)
    scheduler.slo.costs.seed({}, 0.001)
    clock.now = 1.0
    add(scheduler, 200, "long", arrival=0.0)  # waited past the bound: due, first
    add(scheduler, 30, "short", arrival=0.95, ttft=0.1)  # 20 ms of slack: the threshold is the floor, 16
    assert step(scheduler, clock)[0] == [("long", 0, 16), ("short", 0, 30)]


def test_the_step_threshold_fits_the_tightest_target_and_never_drops_below_the_floor():
    scheduler, _ = make_scheduler(ttft_slo_ms=1000.0)
    slo = scheduler.slo
    assert slo.floor == 16  # 4% of max_model_len 256 is below every bucket: the smallest
    slo.costs.seed({1: 0.004}, 0.001)  # a decode step of one row: 4 ms; a prefill token: 1 ms
    assert slo.long_prefills([], [], 0.0)[0] == 64  # half of 1 s fits the whole budget
    short = Sequence("s", 0, list(range(20)), SamplingParams(), seed=0, arrival_time=-0.14)
    short.ttft_slo = 0.2  # 40 ms of slack after its own 20 tokens: 32 tokens of a long prefill fit beside it
    assert slo.long_prefills([], [short], 0.0)[0] == 32
    long = Sequence("l", 0, list(range(150)), SamplingParams(), seed=0, arrival_time=0.0)
    long.ttft_slo = 1.0
    is_short = slo.long_prefills([], [short, long], 0.0)[1]  # short: its prefill within half the tightest target
    assert is_short(short) and not is_short(long)
    decoding = Sequence("d", 0, list(range(20)), SamplingParams(), seed=0, arrival_time=0.0)
    decoding.token_ids.append(7)
    decoding.first_token_time, decoding.tpot_slo = 0.0, 0.06  # half its TPOT target less its decode: 26 tokens
    assert slo.long_prefills([decoding], [short], 0.0)[0] == 16
    decoding.token_ids += [7] * 100
    decoding.first_token_time = -1.0  # 101 tokens in 1 s: 5 s of TPOT room built up, not for long prefills
    assert slo.long_prefills([decoding], [short], 0.0)[0] == 16
    decoding.tpot_slo = 0.005  # no bucket fits: the floor
    assert slo.long_prefills([decoding], [short], 0.0)[0] == 16
    slo.costs.seed({}, 0.0)
    assert slo.long_prefills([], [short], 0.0)[0] == 16  # nothing measured: the floor
    assert make_scheduler()[0].slo.long_prefills([], [], 0.0)[0] == 64  # no target anywhere: no limit


@pytest.mark.parametrize("options, field", [
    (dict(ttft_slo_ms=-1.0), "ttft_slo_ms"), (dict(tpot_slo_ms=0), "tpot_slo_ms"),
    (dict(slo_max_wait_ms=-5.0), "slo_max_wait_ms"), (dict(scheduling_policy="edf"), "scheduling_policy"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills"),
    (dict(ttft_slo_ms=math.inf), "ttft_slo_ms")])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)


def test_threshold_past_max_model_len_is_refused_and_the_default_is_vllms():
    with pytest.raises(ValueError, match="long_prefill_token_threshold .*max_model_len"):
        EngineConfig(max_model_len=256, long_prefill_token_threshold=300).resolve(256)
    config = EngineConfig(max_model_len=1000, max_num_partial_prefills=2).resolve(1000)
    assert config.long_prefill_token_threshold == 40  # 4% of max_model_len, as vLLM
    assert config.resolve(1000) == config


@pytest.mark.parametrize("field, value", [("ttft_slo_ms", -3), ("tpot_slo_ms", 0.0), ("ttft_slo_ms", "fast"),
                                          ("tpot_slo_ms", True)])
def test_bad_request_targets_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# -- the engine ---------------------------------------------------------------------------------------------------


def test_outputs_do_not_depend_on_the_policy_and_goodput_is_counted(tiny_llama_dir, caplog):
    """fcfs, slo with vLLM's limits set, and slo left to set its own (start-up measures the step costs it uses)."""
    from conftest import random_prompts
    from jaxserve import LLM

    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 500, 5, 120, seed=30)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, ttft_slo_ms=600_000.0),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, ttft_slo_ms=1e-3)] * 3
    options = dict(max_num_seqs=4, max_model_len=160, page_size=8, max_num_batched_tokens=64,
                   enable_prefix_caching=False, warmup=False, tpot_slo_ms=600_000.0)
    outputs = {}
    arms = {"fcfs": dict(scheduling_policy="fcfs"),
            "slo": dict(scheduling_policy="slo", long_prefill_token_threshold=32, max_num_partial_prefills=2),
            "slo-own-limits": dict(scheduling_policy="slo", warmup=True)}
    for arm, extra in arms.items():
        with caplog.at_level("INFO", logger="jaxserve.engine.slo"):
            llm = LLM(tiny_llama_dir, num_kv_pages=24, **{**options, **extra})
        if arm == "slo-own-limits":
            costs = llm.llm_engine.scheduler.slo.costs
            assert costs.per_prefill_token > 0 and all(costs.decode_seconds(rows) > 0 for rows in (1, 4))
            assert "long prefills take at most" in caplog.text
        outputs[arm] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        goodput = {kind: (checked, met) for kind, checked, met in llm.llm_engine.stats().request_slo}
        # every request had both targets; the 600 s ones were met, the 1 microsecond TTFTs were not
        assert goodput == {"ttft": (6, 3), "tpot": (6, 6), "both": (6, 3)}, arm
        assert llm.llm_engine.stats().num_preemptions > 0  # and under preemption
    assert outputs["slo"] == outputs["fcfs"] == outputs["slo-own-limits"]
