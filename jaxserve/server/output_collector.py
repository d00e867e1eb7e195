"""`OutputCollector`: the outputs waiting for one HTTP request's handler, at most one per engine request.

The engine thread delivers an output per step for every request that changed; a handler can fall
behind (a slow streaming client). Rather than a queue that grows with the lag, a newer output is
folded into the one still waiting (vLLM's `RequestOutputCollector` idea): DELTA outputs merge (text
concatenated, token ids and logprobs extended, the latest finish state and metrics, the prompt logprobs of
whichever had them), other kinds
replace the waiting one, which the newer one contains. Memory per request stays bounded and nothing
is lost. Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses

from jaxserve.outputs import CompletionOutput, RequestOutput


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One DELTA output carrying what `older` and then `newer` carry (neither is modified)."""
    completions = {completion.index: completion for completion in older.outputs}
    for completion in newer.outputs:
        previous = completions.get(completion.index)
        completions[completion.index] = completion if previous is None else _merge_completion(previous, completion)
    prompt_logprobs = newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs
    return dataclasses.replace(newer, outputs=[completions[index] for index in sorted(completions)],
                               prompt_logprobs=prompt_logprobs)


def _merge_completion(previous: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None
    if previous.logprobs is not None or new.logprobs is not None:
        logprobs = (previous.logprobs or []) + (new.logprobs or [])
    return dataclasses.replace(new, text=previous.text + new.text, token_ids=previous.token_ids + new.token_ids,
                               logprobs=logprobs)


class OutputCollector:
    """Pending outputs keyed by engine request id; `get()` waits for some and takes them all."""

    def __init__(self, delta: bool):
        self._delta = delta
        self._pending: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def put(self, request_id: str, output: RequestOutput) -> None:
        older = self._pending.get(request_id)
        self._pending[request_id] = merge_delta(older, output) if older is not None and self._delta else output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Makes the next `get()` raise `error` (the request was ended by the server)."""
        self._error = error
        self._ready.set()

    async def get(self) -> list[tuple[str, RequestOutput]]:
        """Waits until an output or a failure is pending; returns the outputs (oldest request first) or raises."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        items = list(self._pending.items())
        self._pending.clear()
        return items
