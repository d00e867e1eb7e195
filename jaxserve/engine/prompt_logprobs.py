"""Host side of prompt scoring: what one scoring prefill row brought back (`ScoredPrompt`) as vLLM's prompt_logprobs
entries, `{token_id: Logprob(logprob, rank, decoded_token)}` for the prompt token and the top k."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from jaxserve.outputs import Logprob

if TYPE_CHECKING:
    from jaxserve.layers.prompt_logprobs import PromptScores

MAX_CACHED_TEXTS = 200_000


@dataclasses.dataclass
class ScoredPrompt:
    """Prompt tokens `first, first + 1, ...` of a sequence scored by one prefill row: per token, its logprob given
    the tokens before it, its rank, and the top-k (k = params.prompt_logprobs) ids and logprobs."""

    seq_id: int
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def scored_prompt(seq_id: int, k: int, tokens: range, start: int, scores: PromptScores, row: int) -> ScoredPrompt:
    """The scores (with the top `k`) of prompt `tokens` from one row of a scoring prefill whose chunk starts at
    `start` (token j is predicted at position j - 1)."""
    positions = slice(tokens.start - 1 - start, tokens.stop - 1 - start)
    return ScoredPrompt(seq_id, tokens.start, scores.logprobs[row, positions].tolist(),
                        scores.ranks[row, positions].tolist(), scores.top_ids[row, positions, :k].tolist(),
                        scores.top_logprobs[row, positions, :k].tolist())


class TokenTexts:
    """One token's text, decoded alone by the tokenizer (as vLLM's `decoded_token`), cached; None without one."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._texts) < MAX_CACHED_TEXTS:
                self._texts[token_id] = text
        return text


def prompt_logprob_entries(scored: ScoredPrompt, prompt_token_ids: list[int],
                           token_text: Callable[[int], str | None]) -> list[dict[int, Logprob]]:
    """One dict per scored prompt token: that token first (with its own rank), then the top k not already in it."""
    entries = []
    for offset, (logprob, rank, ids, values) in enumerate(zip(scored.logprobs, scored.ranks, scored.top_ids,
                                                              scored.top_logprobs)):
        token = prompt_token_ids[scored.first + offset]
        entry = {token: Logprob(logprob, rank, token_text(token))}
        for top_rank, (top_id, value) in enumerate(zip(ids, values), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, top_rank, token_text(top_id))
        entries.append(entry)
    return entries
