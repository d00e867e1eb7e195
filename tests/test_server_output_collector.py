"""`OutputCollector`: a consumer that falls behind gets the pending deltas of a request merged into one."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.server.output_collector import OutputCollector, merge_delta


def delta(request_id: str, completions: list[CompletionOutput], finished: bool = False,
          last_token_time: float = 1.0) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], completions, finished,
                         RequestMetrics(0.0, 0.0, 0.5, last_token_time))


def completion(index: int, text: str, token_ids: list[int], logprobs=None, finish_reason=None, stop_reason=None,
               cumulative_logprob=None) -> CompletionOutput:
    return CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason)


def test_merge_concatenates_text_extends_tokens_and_logprobs_and_keeps_the_latest_state():
    older = delta("r", [completion(0, "Hel", [5], [{5: -0.1}], cumulative_logprob=-0.1),
                        completion(1, "A", [9], [{9: -0.3}], cumulative_logprob=-0.3)], last_token_time=1.0)
    newer = delta("r", [completion(0, "lo!", [6, 7], [{6: -0.2}, {7: -0.4}], "stop", "!!", -0.7)],
                  finished=False, last_token_time=2.0)
    merged = merge_delta(older, newer)
    first, second = merged.outputs
    assert (first.index, first.text, first.token_ids, first.logprobs) == (0, "Hello!", [5, 6, 7],
                                                                           [{5: -0.1}, {6: -0.2}, {7: -0.4}])
    assert (first.finish_reason, first.stop_reason, first.cumulative_logprob) == ("stop", "!!", -0.7)
    assert second == older.outputs[1]  # unchanged in the newer output: kept as it was
    assert merged.metrics.last_token_time == 2.0 and not merged.finished
    assert older.outputs[0].token_ids == [5] and older.outputs[0].text == "Hel"  # inputs are not modified


def test_merge_without_logprobs_and_in_index_order():
    older = delta("r", [completion(1, "b", [2])])
    newer = delta("r", [completion(0, "a", [1], finish_reason="length"), completion(1, "c", [3])], finished=True)
    merged = merge_delta(older, newer)
    assert [(c.index, c.text, c.token_ids, c.logprobs) for c in merged.outputs] == [(0, "a", [1], None),
                                                                                    (1, "bc", [2, 3], None)]
    assert merged.finished


def test_merge_keeps_the_prompt_logprobs_of_the_first_delta():
    """A DELTA request's first output alone carries its prompt logprobs (a stream's echo needs them)."""
    prompt_logprobs = [None, {2: Logprob(-1.5, 3, "b")}]
    older = dataclasses.replace(delta("r", [completion(0, "a", [1])]), prompt_logprobs=prompt_logprobs)
    newer = delta("r", [completion(0, "b", [2])])
    assert merge_delta(older, newer).prompt_logprobs == prompt_logprobs
    assert merge_delta(newer, older).prompt_logprobs == prompt_logprobs


def test_a_consumer_that_falls_behind_gets_one_merged_output_per_request():
    async def main() -> None:
        collector = OutputCollector(delta=True)
        for step in range(1000):
            collector.put("r0", delta("r0", [completion(0, "x", [step])], finished=step == 999))
            collector.put("r1", delta("r1", [completion(0, "y", [step])]))
            assert collector.num_pending == 2  # bounded, however far behind the consumer is
        items = dict(await collector.get())
        assert items["r0"].outputs[0].text == "x" * 1000 and items["r0"].outputs[0].token_ids == list(range(1000))
        assert items["r0"].finished and not items["r1"].finished
        assert collector.num_pending == 0
        collector.put("r1", delta("r1", [completion(0, "z", [7])]))
        (request_id, output), = await collector.get()
        assert (request_id, output.outputs[0].text) == ("r1", "z")

    asyncio.run(main())


def test_non_delta_outputs_replace_the_pending_one():
    async def main() -> None:
        collector = OutputCollector(delta=False)
        collector.put("r", delta("r", [completion(0, "ab", [1, 2])]))
        collector.put("r", delta("r", [completion(0, "abc", [1, 2, 3])], finished=True))
        (_, output), = await collector.get()
        assert output.outputs[0].text == "abc" and output.finished

    asyncio.run(main())


def test_get_waits_for_an_output_and_raises_a_failure():
    async def main() -> None:
        collector = OutputCollector(delta=True)
        waiting = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        collector.put("r", delta("r", [completion(0, "a", [1])]))
        assert len(await waiting) == 1
        collector.fail(RuntimeError("engine gone"))
        with pytest.raises(RuntimeError, match="engine gone"):
            await collector.get()

    asyncio.run(main())
