"""A draft model for speculative decoding: a smaller model with the target's vocabulary, in the same engine. Here:
its config check (`draft_model_config`) and its proposal step; the runner holds its params, pool and jitted steps
(`engine/speculator.py`).

The draft has its own params and its own paged KV pool, with as many pages as the target's and the same page
tables: page p of a sequence holds the same positions in both pools, so prefix caching, preemption and
rollback of rejected tokens need no bookkeeping of their own. Every target prefill is mirrored into the draft
pool (the engine's prefill step on the draft's params). A proposal (`propose_step`) first feeds the row's last
two tokens (positions p-1 and p: the draft may lack the KV of p-1 when every draft of the previous step was
accepted, and writing it again gives the same values), then K-1 single tokens, each sampled from the draft's own
distribution with the row's sampling parameters (the argmax for greedy rows); the drafts and, for sampled rows,
their distributions q stay on the device for the verify step.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.sampler import SamplingBatch, argmax, inverse_cdf, row_uniforms, sampling_logits
from jaxserve.models import forward
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.verify import draft_positions

DRAFT_STREAM = 2  # `row_uniforms` stream of the draft's own draws


@flax.struct.dataclass
class ProposeInputs:
    """The rows of a verify call, as the draft model's proposal reads them."""

    slots: jax.Array  # int32 [rows]
    positions: jax.Array  # int32 [rows]: the position of each row's latest token
    last_tokens: jax.Array  # int32 [rows, 2]: each row's two latest tokens (what the draft feeds first)
    pages: jax.Array  # int32 [rows, K + 1]: the pages of positions p..p+K
    num_draft: jax.Array  # int32 [rows]: drafts each row may have
    active: jax.Array  # bool [rows]
    output_index: jax.Array  # int32 [rows]


@flax.struct.dataclass
class Proposal:
    draft_tokens: jax.Array  # int32 [rows, K]
    draft_probs: jax.Array | None  # float32 [rows, K, vocab]: the draft's distributions (None: greedy drafts)


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig, max_model_len: int) -> ModelConfig:
    """The draft's `ModelConfig` (read without its weights); ValueError naming `model` if it cannot serve."""
    from jaxserve.loading import model_config, resolve_model

    try:
        config = model_config(resolve_model(spec.model))
    except ValueError as err:
        raise ValueError(f"speculative_config 'model': {err}") from err
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config 'model' {spec.model!r} has a vocabulary of {config.vocab_size} tokens, "
                         f"the target's has {target.vocab_size}: a draft must share the target's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config 'model' {spec.model!r} has a context of "
                         f"{config.max_position_embeddings} tokens, shorter than max_model_len ({max_model_len})")
    if config.linear_attention is not None:  # its proposals would have to roll its own state back
        raise ValueError(f"speculative_config 'model' {spec.model!r} has linear-attention layers: a draft model "
                         "with a per-sequence state is not supported yet (the target may have them)")
    return config


def propose_step(config, tp, backend, dtype, page_size, with_probs: bool, params, kv_cache, slot_state,
                 table: SamplingBatch, inputs: ProposeInputs):
    """K = `pages.shape[1] - 1` draft tokens per row (`[rows, K]`) and, `with_probs`, the draft's distributions
    (`[rows, K, vocab]`, float32). Row r's latest token sits at `positions[r]`; `last_tokens [rows, 2]` are its
    two last tokens; `pages [rows, K+1]` the pages of positions p..p+K (the target's verify step writes the same
    into the slot's page table). `slot_state` is the target's (`SlotState`: its page tables are read, not
    written; one KV cache group, as a draft model turns the hybrid KV cache off); the new state is the draft's
    pool."""
    slots, positions, pages, num_draft, active = (inputs.slots, inputs.positions, inputs.pages, inputs.num_draft,
                                                  inputs.active)
    output_index = inputs.output_index
    rows, width = pages.shape
    k = width - 1
    sampling = jax.tree.map(lambda column: column[slots], table)
    valid = active[:, None] & (jnp.arange(width)[None, :] <= num_draft[:, None])
    positions2d, slot_mapping, page_tables = draft_positions(slot_state.page_tables[0], page_size, slots, positions,
                                                             pages, valid)
    row_tables = page_tables[slots]
    previous = jnp.maximum(positions - 1, 0)
    previous_page = jnp.take_along_axis(row_tables, (previous // page_size)[:, None], axis=1)[:, 0]
    previous_slot = jnp.where(active, previous_page * page_size + previous % page_size, 0)

    def choose(logits, i):
        greedy = argmax(logits)
        if not with_probs:
            return greedy, None
        index = output_index + i
        q = jax.nn.softmax(sampling_logits(logits, sampling.replace(output_index=index)), axis=-1)
        drawn = inverse_cdf(q, row_uniforms(sampling.seed, index, DRAFT_STREAM))
        return jnp.where(sampling.temperature == 0, greedy, drawn), q

    meta = AttentionMetadata(positions=jnp.stack([previous, positions], axis=1),
                             slot_mapping=jnp.stack([previous_slot, slot_mapping[:, 0]], axis=1),
                             page_tables=row_tables, context_lens=jnp.where(active, positions + 1, 0),
                             query_lens=jnp.where(active, 2, 0))
    logits, kv_cache = forward(params, config, backend, inputs.last_tokens, kv_cache, meta,
                               logits_indices=jnp.ones((rows,), jnp.int32), dtype=dtype, tp=tp)
    token, q = choose(logits, 0)
    drafts, probs = [token], [q]
    for i in range(1, k):  # draft i goes in at position p + i
        feeds = active & (i < num_draft)
        meta = AttentionMetadata(positions=positions2d[:, i:i + 1],
                                 slot_mapping=jnp.where(feeds, slot_mapping[:, i], 0)[:, None],
                                 page_tables=row_tables, context_lens=jnp.where(feeds, positions + i + 1, 0),
                                 query_lens=jnp.ones((rows,), jnp.int32))
        logits, kv_cache = forward(params, config, backend, token[:, None], kv_cache, meta,
                                   logits_indices=jnp.zeros((rows,), jnp.int32), dtype=dtype, tp=tp)
        token, q = choose(logits, i)
        drafts.append(token)
        probs.append(q)
    return Proposal(jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1) if with_probs else None), (kv_cache,)
