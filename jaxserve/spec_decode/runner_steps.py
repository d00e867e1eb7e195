"""`SpeculativeSteps`: the speculative-decoding part of `ModelRunner` (a mixin over the runner's state: params,
pools, slot state, penalties, sampling table): proposing drafts (n-gram lookup on the host, or the draft model's
jitted proposal), the verify forward and its sampler, reading a verify call's tokens, and the shapes warm-up
compiles for them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.engine.input_batch import VerifyInputs, verify_inputs
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_output import SampledToken, sampled_token
from jaxserve.layers.sampler import SampleResult
from jaxserve.spec_decode.ngram import NgramIndex


class SpeculativeSteps:
    """Needs the runner's `ngram` (the n-gram config, or None), `draft` (a DraftModel, or None), `spec_counters`
    and its jitted `_verify` / `_verify_sample`."""

    def _verify_inputs(self, seqs: list[Sequence]) -> VerifyInputs | None:
        """The verify call for this step's decodes, or None when no sequence has drafts (a plain decode then)."""
        if not any(seq.num_lookahead for seq in seqs) or any(seq.grammar is not None for seq in seqs):
            return None  # constrained rows decode without drafts (the verify sampler applies no token mask)
        drafts = None
        if self.ngram is not None:
            drafts = []
            for seq in seqs:
                if seq.ngram_index is None:
                    seq.ngram_index = NgramIndex(self.ngram.prompt_lookup_min, self.ngram.prompt_lookup_max)
                drafts.append(seq.ngram_index.propose(seq.token_ids, seq.num_lookahead) if seq.num_lookahead else [])
            if not any(drafts):
                return None
        return verify_inputs(seqs, drafts, self.engine_config, self.engine_config.num_speculative_tokens)

    def verify(self, inputs: VerifyInputs) -> SampleResult:
        """Proposes (a draft model, on the device) and verifies K drafts per row in one forward of the target; each
        row's output tokens, still on the device (`SampleResult.num_accepted`)."""
        rows = len(inputs.seqs)
        plain = self.slot_params.is_plain_greedy(inputs.slots, inputs.output_index, rows)
        draft_tokens, draft_probs = inputs.draft_tokens, None
        if self.draft is not None:
            kind = "propose" if plain else "propose_probs"
            self._send_sampling_table()
            draft_tokens, draft_probs, self.draft.kv_cache = self._call(
                kind, self._jitted[kind], self._state(kind),
                (inputs.slots, inputs.positions, inputs.last_tokens, inputs.pages, inputs.num_draft, inputs.active,
                 inputs.output_index))
        logits, greedy, self.kv_cache, self.slot_state = self._call(
            "verify", self._verify, (self.params, self.kv_cache, self.slot_state),
            (inputs.slots, inputs.positions, draft_tokens, inputs.num_draft, inputs.pages, inputs.active))
        if plain:
            return greedy
        self._send_sampling_table()
        result, self.penalties, self.slot_state = self._call(
            "verify_sample", self._verify_sample, self._state("verify_sample"),
            (logits, draft_tokens, inputs.num_draft, draft_probs, inputs.slots, inputs.output_index, inputs.active))
        return result

    def _verified(self, rows, result: SampleResult, num_draft: np.ndarray) -> list[SampledToken]:
        """A verify call's output tokens, row by row: the accepted drafts, then the token sampled after them."""
        accepted = np.minimum(result.num_accepted, num_draft)
        self.spec_counters.count(num_draft[:len(rows)], accepted[:len(rows)])
        tokens = result.tokens.tolist()
        sampled = []
        for row, seq in rows:
            count = int(accepted[row])
            for i in range(count + 1):
                sample = (SampledToken(seq, tokens[row][i]) if seq.params.logprobs is None
                          else sampled_token(seq, result, (row, i)))
                sample.accepted_draft = i < count
                sampled.append(sample)
        return sampled

    def _speculative_examples(self, replicated):
        """The verify, verify-sampler and draft-model shapes of every batch bucket (none without speculation)."""
        ec, k = self.engine_config, self.engine_config.num_speculative_tokens
        if not k:
            return
        vocab = self.config.vocab_size
        if self.draft is not None:
            for rows, tokens in ec.prefill_shapes:
                zeros = np.zeros(rows, np.int32)
                yield "draft_prefill", (np.zeros((rows, tokens), np.int32), zeros, zeros,
                                        np.zeros((rows, ec.pages_per_seq), np.int32), zeros, np.zeros(rows, bool), zeros)
        for rows in ec.decode_batch_buckets:
            zeros, no = np.zeros(rows, np.int32), np.zeros(rows, bool)
            drafts = np.zeros((rows, k), np.int32)  # a draft model's come from its proposal, on the device
            drafts = jnp.asarray(drafts, device=replicated) if self.draft is not None else drafts
            proposal = (zeros, zeros, np.zeros((rows, 2), np.int32), np.zeros((rows, k + 1), np.int32), zeros, no,
                        zeros)
            yield "verify", (zeros, zeros, drafts, zeros, np.zeros((rows, k + 1), np.int32), no)
            logits = jnp.zeros((rows, k + 1, vocab), jnp.float32, device=replicated)
            probs = [None]
            if self.draft is not None:
                yield "propose", proposal
                yield "propose_probs", proposal
                probs = [jnp.zeros((rows, k, vocab), jnp.float32, device=replicated)]
            for draft_probs in probs:
                yield "verify_sample", (logits, drafts, zeros, draft_probs, zeros, zeros, no)
