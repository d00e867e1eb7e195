"""`StartupSteps`: the start-up part of `ModelRunner` (a mixin over the runner's state): every shape a step can
have, with example inputs that write only to the scratch page, compiled ahead in a thread pool and run once
(`warmup`), and `replay`, which runs one call as the runner would and keeps only its new state (how warm-up runs
its examples, and how a multi-host follower runs the leader's calls)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.distributed.shardings import REPLICATED
from jaxserve.engine.config import power_of_two_buckets
from jaxserve.engine.slot_params import SlotSamplingParams

BAN_IDS_CHUNK = 16  # banned ids (EOS, stop_token_ids) are written this many per call, so one shape serves any count


class StartupSteps:
    @property
    def sampler_rows(self) -> list[int]:
        """The row counts a sampler call can have: every prefill call's and decode bucket's."""
        ec = self.engine_config
        return sorted({rows for rows, _ in ec.prefill_shapes} | set(ec.decode_batch_buckets))

    @property
    def reset_buckets(self) -> tuple[int, ...]:
        """Token-count buckets of the penalty reset at admission (prompt + output so far, up to max_model_len)."""
        return power_of_two_buckets(16, max(16, self.engine_config.max_model_len))

    def example_inputs(self):
        """`(kind, inputs)` for every shape the engine can run; they write only to the scratch page, and no slot."""
        ec = self.engine_config
        replicated = NamedSharding(self.mesh, REPLICATED)
        for rows, tokens in ec.prefill_shapes:
            zeros = np.zeros(rows, np.int32)
            yield "prefill", (np.zeros((rows, tokens), np.int32), zeros, zeros,
                              np.zeros((rows, ec.pages_per_seq), np.int32), zeros, np.zeros(rows, bool), zeros)
            hidden = jnp.zeros((rows, tokens, self.config.hidden_size), self.dtype, device=replicated)  # a prefill's
            yield "score", (hidden, np.zeros((rows, tokens), np.int32), zeros, zeros)
        for rows in ec.decode_batch_buckets:
            zeros = np.zeros(rows, np.int32)
            yield "decode", (zeros, zeros, zeros, np.zeros(rows, bool))
        yield "table", (SlotSamplingParams(ec.max_num_seqs).table(),)
        for rows in self.sampler_rows:
            zeros = np.zeros(rows, np.int32)
            logits = jnp.zeros((rows, self.config.vocab_size), jnp.float32, device=replicated)  # as a forward's
            yield "sample", (logits, zeros, zeros, np.zeros(rows, bool), self._all_allowed[rows])
        for length in self.reset_buckets:
            yield "reset", (np.int32(0), np.zeros(length, np.int32), np.int32(0), np.int32(0))
        yield "ban", (np.int32(0), np.full(BAN_IDS_CHUNK, -1, np.int32))
        yield from self._speculative_examples(replicated)

    def _state(self, kind: str) -> tuple:
        if kind in ("reset", "ban"):
            return (self.penalties,)
        if kind in ("sample", "verify_sample"):
            return self.penalties, self.slot_state, self.sampling_table
        if kind == "table":
            return ()
        if kind == "score":
            return (self.params,)
        if kind == "draft_prefill":
            return self.draft.params, self.draft.kv_cache, self.draft.slot_state
        if kind in ("propose", "propose_probs"):
            return self.draft.params, self.draft.kv_cache, self.slot_state, self.sampling_table
        return self.params, self.kv_cache, self.slot_state

    def replay(self, kind: str, inputs: tuple) -> None:
        """Runs one call as `_call` would and keeps only its new state: how a multi-host follower runs the
        leader's calls, and how warm-up runs its examples. A follower's sampler call comes without logits: it
        samples the logits of its own latest forward, the leader's call before it (a scoring call likewise reads
        its latest prefill's last-layer output)."""
        if kind == "sample" and inputs[0] is None:
            inputs = (self._follower_logits, *inputs[1:])
        if kind == "score" and inputs[0] is None:
            inputs = (self._follower_hidden, *inputs[1:])
        outputs = self._call(kind, self._jitted[kind], self._state(kind), inputs)
        if kind in ("reset", "ban"):
            self.penalties = outputs
        elif kind == "table":
            self.sampling_table = outputs
        elif kind in ("sample", "verify_sample"):
            _, self.penalties, self.slot_state = outputs
        elif kind == "draft_prefill":
            _, _, self.draft.kv_cache, self.draft.slot_state = outputs
        elif kind in ("propose", "propose_probs"):
            self.draft.kv_cache = outputs[2]
        elif kind == "prefill":
            self._follower_logits, _, self.kv_cache, self.slot_state, self._follower_hidden = outputs
        elif kind != "score":  # a scoring call's scores only the leader reads
            self._follower_logits, _, self.kv_cache, self.slot_state = outputs

    def warmup(self) -> float:
        """Compiles every shape ahead of time (lowered in turn, each compiled in a pool as soon as it is
        lowered), then runs each once through the jitted functions, which reuse those executables, since an
        executable's first run is slower than later ones and would otherwise land on a request."""
        started = time.perf_counter()
        compiling = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # compiling frees the GIL
            for kind, inputs in self.example_inputs():
                key = (kind, shape_key(inputs))
                if key not in compiling:
                    compiling[key] = pool.submit(self._jitted[kind].lower(*self._state(kind), *inputs).compile)
            for future in compiling.values():
                future.result()
        for kind, inputs in self.example_inputs():
            self.replay(kind, inputs)
        jax.block_until_ready((self.kv_cache, self.penalties, self.slot_state,
                               self.draft.kv_cache if self.draft is not None else None))
        self._cache_sizes = {kind: jitted._cache_size() for kind, jitted in self._jitted.items()}
        self._warm = True
        return time.perf_counter() - started


def shape_key(args) -> tuple:
    """The shapes and dtypes of a step's inputs past the state arguments: which executable serves them."""
    return tuple((leaf.shape, leaf.dtype.name) for leaf in jax.tree.leaves(args))
