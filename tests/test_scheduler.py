"""Scheduling under the token budget: decodes first, prefill chunks charged their padded bucket size."""

from jaxserve.engine.page_manager import PageManager
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import SamplingParams


def make_scheduler(budget: int = 64, num_pages: int = 200, prefix_caching: bool = False) -> Scheduler:
    config = EngineConfig(max_num_seqs=8, max_model_len=256, page_size=8, max_num_batched_tokens=budget)
    config = config.resolve(256)
    assert config.prefill_buckets == (16, 32, 64)
    return Scheduler(config, PageManager(num_pages=num_pages, page_size=8, enable_prefix_caching=prefix_caching))


def add(scheduler: Scheduler, prompt_len: int, request_id: str) -> Sequence:
    seq = Sequence(request_id, 0, list(range(1, prompt_len + 1)), SamplingParams(), seed=0, arrival_time=0.0)
    scheduler.add(seq)
    return seq


def run_step(scheduler: Scheduler, next_token: int = 7):
    """Schedules a step and applies it as the engine would: computed tokens advance, finished chunks sample. Returns
    the plan with its sequences: (prefills as (seq, start, num_tokens), decodes, admitted)."""
    plan = scheduler.schedule()
    prefills = [(scheduler.seqs[chunk.seq_id], chunk.start, chunk.num_tokens) for chunk in plan.prefills]
    decodes = [scheduler.seqs[decode.seq_id] for decode in plan.decodes]
    for chunk in plan.prefills:
        seq = scheduler.seqs[chunk.seq_id]
        seq.num_computed_tokens += chunk.num_tokens
        if chunk.is_final:
            seq.token_ids.append(next_token)
    for seq in decodes:
        seq.num_computed_tokens += 1
        seq.token_ids.append(next_token)
    return prefills, decodes, [scheduler.seqs[new.seq_id] for new in plan.new_seqs]


def test_prefill_chunks_are_charged_their_bucket():
    scheduler = make_scheduler()
    first, second, third = (add(scheduler, 20, name) for name in ("a", "b", "c"))
    prefills, _, _ = run_step(scheduler)
    # 20-token chunks pad to the 32 bucket: two fill the 64-token budget, the third waits
    assert prefills == [(first, 0, 20), (second, 0, 20)]
    assert scheduler.waiting[0] is third
    prefills, decodes, _ = run_step(scheduler)
    # decodes are not charged: the third prompt gets the budget
    assert decodes == [first, second] and prefills == [(third, 0, 20)]


def test_a_long_prompt_takes_the_largest_bucket_that_fits():
    scheduler = make_scheduler()
    short, long = add(scheduler, 10, "short"), add(scheduler, 100, "long")
    prefills, _, _ = run_step(scheduler)
    # the short prompt is charged 16; 48 tokens would pad to 64, over budget, so the long one gets a whole 32
    assert prefills == [(short, 0, 10), (long, 0, 32)]
    prefills, decodes, _ = run_step(scheduler)
    assert decodes == [short] and prefills == [(long, 32, 64)]
    prefills, _, _ = run_step(scheduler)
    assert prefills == [(long, 96, 4)]
    assert long.num_output_tokens == 1


def test_prefix_lookups_count_once_per_admission():
    """A request that cannot be admitted for lack of pages is looked up again each step, but counted once."""
    scheduler = make_scheduler(num_pages=6, prefix_caching=True)
    first = add(scheduler, 32, "first")  # 4 pages of 5 usable
    run_step(scheduler)
    waiting = add(scheduler, 30, "waiting")
    for _ in range(3):
        _, _, admitted = run_step(scheduler)
        assert waiting not in admitted
    manager = scheduler.page_manager
    assert manager.num_prefix_queries == 32
    scheduler.finish(first, "stop")
    _, _, admitted = run_step(scheduler)
    assert admitted == [waiting] and manager.num_prefix_queries == 62



def test_prefill_buckets_start_at_64_tokens_on_an_accelerator():
    """A forward of 64 tokens or fewer reads the weights as one of 16 does on a GPU or TPU: the smallest bucket
    there is 64 (two fewer prefill shapes per halving to compile at start-up); 16 on a CPU; or as set."""
    config = EngineConfig(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048)
    assert config.resolve(4096, platform="gpu").prefill_buckets == (64, 128, 256, 512, 1024, 2048)
    assert config.resolve(4096, platform="tpu").prefill_shapes[-1] == (4, 512)
    assert config.resolve(4096, platform="cpu").prefill_buckets[0] == 16
    explicit = EngineConfig(max_num_batched_tokens=64, smallest_prefill_bucket=32).resolve(4096, platform="tpu")
    assert explicit.prefill_buckets == (32, 64) and explicit.resolve(4096).prefill_buckets == (32, 64)
    try:
        EngineConfig(smallest_prefill_bucket=48)
    except ValueError as err:
        assert "smallest_prefill_bucket must be a power of two, got 48" in str(err)
    else:
        raise AssertionError("48 accepted")


def add_images(scheduler: Scheduler, prompt_len: int, request_id: str, images: list[tuple[str, int, int]]) -> Sequence:
    """A prompt with image placeholders: (image name, offset, tokens) each; its hash: the name (a hex digit) 8 times."""
    from jaxserve.multimodal.inputs import ImageInput, MultiModalPrompt

    seq = Sequence(request_id, 0, list(range(1, prompt_len + 1)), SamplingParams(), seed=0, arrival_time=0.0)
    seq.set_images(MultiModalPrompt(tuple(ImageInput(name * 8, offset, tokens, None, (1, 1, 1))
                                          for name, offset, tokens in images)))
    scheduler.add(seq)
    return seq


def test_the_encoder_budget_bounds_a_steps_images_and_the_cache_evicts_what_the_runner_drops():
    """A step encodes images up to the encoder budget (a chunk stops before the image past it; a step's first image
    goes whatever its size); images the cache holds cost nothing; past the cache's size the least recently used
    image not read this step is evicted, and the step tells the runner to drop it."""
    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager

    scheduler = make_scheduler()
    scheduler.encoder_cache = manager = EncoderCacheManager(cache_size=48, step_budget=24)
    a = add_images(scheduler, 40, "a", [("a", 4, 12), ("b", 20, 12), ("c", 34, 6)])
    prefills, _, _ = run_step(scheduler)
    assert prefills == [(a, 0, 34)]  # images a and b fill the budget: the chunk stops before c
    b = add_images(scheduler, 40, "b", [("a", 2, 12), ("d", 16, 24)])
    prefills, _, _ = run_step(scheduler)
    # c (6 rows) and d (24) pass the budget together: b's chunk reads a (held, free) and stops before d
    assert prefills == [(a, 34, 6), (b, 0, 16)]
    plan = scheduler.schedule()
    assert [(chunk.seq_id, chunk.start, chunk.num_tokens) for chunk in plan.prefills] == [(b.seq_id, 16, 24)]
    # 12 + 12 + 6 + 24 rows passed 48: the least recently used image outside this step (b) is dropped
    assert plan.encoder_frees == ("b" * 8,)
    c = add_images(scheduler, 60, "c", [("e", 0, 50)])
    scheduler.update_after_dispatch(plan)
    plan = scheduler.schedule()
    # a step's first image goes over the budget; the cache drops every image but it, though it alone passes 48 rows
    assert [(chunk.seq_id, chunk.start, chunk.num_tokens) for chunk in plan.prefills] == [(c.seq_id, 0, 60)]
    assert plan.encoder_frees == ("c" * 8, "a" * 8, "d" * 8)
    assert list(manager._held) == ["e" * 8]
