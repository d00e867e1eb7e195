"""A speculative head's device steps (pure functions, jitted by `engine/speculative_head.py`): an EAGLE-3 head
(`eagle3.py`) or a model's own multi-token-prediction layer (`mtp.py`), each a `Head`, reading the target's hidden
states. The head keeps its own one-layer paged KV pool, named by the target's page tables (group 0), and a ring of
the target's hidden states (the inputs of the layers it reads: `Head.aux_layers`) per slot.

* `head_prefill_step`: after a target prefill call, the head's KV for the chunk's positions, each position j paired
  with the token at j + 1 (the chunk's next token, or for a chunk that is not final the token after it). A final
  chunk's last position waits for the token sampled there: its hidden states go to the slot's ring.
* `head_keep_step`: after a verify (or plain decode) call, the hidden states of its positions into each slot's ring.
* `head_propose_step`: before a verify call, each row first feeds the positions whose KV the head lacks (its
  pending positions, from the ring, with the tokens after them: every token the target accepted since the last
  proposal), then chains K - 1 single positions on its own drafts and outputs. Drafts are the head's argmax (vLLM's
  choice): the verify step treats them as deterministic proposals, so sampled rows keep the target's distribution.

The ring holds `K + 1` positions per slot, indexed by position modulo `K + 1`: a verify call writes K + 1 positions
and the next proposal reads at most those; steps that decoded without speculation leave the head behind by as many
positions, and past K + 1 of them the oldest are never fed (the head's KV there is stale: proposals get worse, the
output does not change).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from typing import Protocol

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.quant_dense import Embedding
from jaxserve.spec_decode.draft import Proposal
from jaxserve.spec_decode.verify import draft_positions


class Head(Protocol):
    """What the steps ask of a head (a frozen config with these pure functions; `target` is the target's config,
    `target_params` its serving params, `tp` the head's split)."""

    layer: ModelConfig  # its decoder layer as a one-layer model: the shape of its KV pool
    aux_layers: tuple[int, ...]  # the target layers whose inputs it reads (`num_layers`: the last one's output)

    def hidden_state(self, params, target_params, target, aux, dtype): ...  # the target's states -> its input
    def run(self, params, target_params, target, tp, backend, dtype, tokens, hidden, kv, meta): ...  # (out, kv)
    def draft(self, params, target_params, target, tp, x, dtype): ...  # its greedy draft after outputs x


@flax.struct.dataclass
class HeadPrefillInputs:
    """A target prefill call's chunks (`PrefillBatch` fields) and its layer inputs `[rows, T, n * hidden]`."""

    token_ids: jax.Array  # int32 [rows, T]
    starts: jax.Array  # int32 [rows]
    num_tokens: jax.Array  # int32 [rows]
    page_tables: jax.Array  # int32 [rows, pages_per_seq]: group 0's
    slots: jax.Array  # int32 [rows]
    is_final: jax.Array  # bool [rows]
    next_tokens: jax.Array  # int32 [rows]
    aux: jax.Array | None  # the prefill's `Forward.aux` (the target's hidden states), on the device


@flax.struct.dataclass
class KeepInputs:
    """A verify or decode call's hidden states `[rows, T, n * hidden]` and where they sit."""

    aux: jax.Array | None
    slots: jax.Array  # int32 [rows]
    positions: jax.Array  # int32 [rows]: the position of each row's first column
    active: jax.Array  # bool [rows]


@flax.struct.dataclass
class HeadProposeInputs:
    slots: jax.Array  # int32 [rows]
    positions: jax.Array  # int32 [rows]: p, the position of each row's latest token
    tokens: jax.Array  # int32 [rows, K + 1]: the tokens after the pending positions p - c .. p - 1, left-aligned
    num_pending: jax.Array  # int32 [rows]: c (1 .. K + 1)
    pages: jax.Array  # int32 [rows, K + 1]: the pages of positions p .. p + K (the verify call's, group 0)
    num_draft: jax.Array  # int32 [rows]
    active: jax.Array  # bool [rows]


def target_embeddings(target_params, target: ModelConfig, tp, token_ids, dtype):
    """The tokens' rows of the target's embedding table, looked up as the target holds it (split over the
    vocabulary under TP): what a head reads its tokens through unless it has a table of its own."""
    from jaxserve.models.llama import vocab_shards

    table = Embedding(target.vocab_size, target.hidden_size, dtype=dtype, vocab_shards=vocab_shards(target, tp))
    return table.apply({"params": target_params["embed"]}, token_ids)


def _flat_slots(page_tables, page_size, positions, valid):
    """Flat KV slots of `positions [rows, T]` in rows' `page_tables [rows, P]` (0, the scratch page, where not
    `valid`)."""
    index = jnp.minimum(positions // page_size, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, index, axis=1)
    return jnp.where(valid, pages * page_size + positions % page_size, 0)


def head_prefill_step(head: Head, target: ModelConfig, tp, backend, dtype, page_size, params, target_params, kv, ring,
                      inputs: HeadPrefillInputs):
    rows, chunk = inputs.token_ids.shape
    column = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    num_fed = jnp.where(inputs.is_final, jnp.maximum(inputs.num_tokens - 1, 0), inputs.num_tokens)
    positions = inputs.starts[:, None] + column
    valid = column < num_fed[:, None]
    following = jnp.concatenate([inputs.token_ids[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
    following = jnp.where(column == inputs.num_tokens[:, None] - 1, inputs.next_tokens[:, None], following)
    meta = AttentionMetadata(positions=positions,
                             slot_mapping=_flat_slots(inputs.page_tables, page_size, positions, valid),
                             page_tables=inputs.page_tables,
                             context_lens=jnp.where(num_fed > 0, inputs.starts + num_fed, 0), query_lens=num_fed)
    _, kv = head.run(params, target_params, target, tp, backend, dtype, following,
                     head.hidden_state(params, target_params, target, inputs.aux, dtype), kv, meta)
    last = jnp.maximum(inputs.num_tokens - 1, 0)
    width = ring.shape[1]
    live = jnp.where(inputs.num_tokens > 0, inputs.slots, ring.shape[0])
    kept = jnp.take_along_axis(inputs.aux, last[:, None, None], axis=1)[:, 0]
    ring = ring.at[live, (inputs.starts + last) % width].set(kept.astype(ring.dtype), mode="drop")
    return None, (kv, ring)


def head_keep_step(ring, inputs: KeepInputs):
    rows, columns, _ = inputs.aux.shape
    width = ring.shape[1]
    positions = inputs.positions[:, None] + jnp.arange(columns, dtype=jnp.int32)[None, :]
    live = jnp.where(inputs.active, inputs.slots, ring.shape[0])
    ring = ring.at[jnp.broadcast_to(live[:, None], positions.shape), positions % width].set(
        inputs.aux.astype(ring.dtype), mode="drop")
    return None, (ring,)


def head_propose_step(head: Head, target: ModelConfig, tp, backend, dtype, page_size, params, target_params, kv, ring,
                      slot_state, inputs: HeadProposeInputs):
    """K = `pages.shape[1] - 1` drafts per row (`Proposal` with no distributions); the new state is the head's
    pool. `slot_state` is the target's (its group-0 page tables are read, not written)."""
    slots, p, c, active, num_draft = (inputs.slots, inputs.positions, inputs.num_pending, inputs.active,
                                      inputs.num_draft)
    rows, width = inputs.pages.shape
    k = width - 1
    valid = active[:, None] & (jnp.arange(width)[None, :] <= num_draft[:, None])
    _, chained_slots, page_tables = draft_positions(slot_state.page_tables[0], page_size, slots, p, inputs.pages,
                                                    valid)
    tables = page_tables[slots]
    column = jnp.arange(width, dtype=jnp.int32)[None, :]
    pending = active[:, None] & (column < c[:, None])
    positions = jnp.maximum(p - c, 0)[:, None] + column
    hidden = ring[slots[:, None], positions % ring.shape[1]]
    meta = AttentionMetadata(positions=positions, slot_mapping=_flat_slots(tables, page_size, positions, pending),
                             page_tables=tables, context_lens=jnp.where(active, p, 0),
                             query_lens=jnp.where(active, c, 0))
    out, kv = head.run(params, target_params, target, tp, backend, dtype, inputs.tokens,
                       head.hidden_state(params, target_params, target, hidden, dtype), kv, meta)
    x = jnp.take_along_axis(out, jnp.maximum(c - 1, 0)[:, None, None], axis=1)  # [rows, 1, H]
    token = head.draft(params, target_params, target, tp, x, dtype)  # [rows, 1]
    drafts = [token[:, 0]]
    for i in range(1, k):  # draft i goes in at position p + i - 1, beside the head's own output there
        feeds = active & (i < num_draft)
        meta = AttentionMetadata(positions=(p + i - 1)[:, None],
                                 slot_mapping=jnp.where(feeds, chained_slots[:, i - 1], 0)[:, None],
                                 page_tables=tables, context_lens=jnp.where(feeds, p + i, 0),
                                 query_lens=jnp.ones((rows,), jnp.int32))
        x, kv = head.run(params, target_params, target, tp, backend, dtype, token, x, kv, meta)
        token = head.draft(params, target_params, target, tp, x, dtype)
        drafts.append(token[:, 0])
    return Proposal(jnp.stack(drafts, axis=1), None), (kv,)
