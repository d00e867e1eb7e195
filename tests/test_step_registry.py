"""A multi-host follower replays the leader's step calls from their frames and ends with the same state, including
a call that takes an earlier call's output after other calls ran (a sampler waiting for its rows' token masks
takes its own forward's logits, not the latest forward's)."""

import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.distributed.wire import CallSignatures, encode_call
from jaxserve.engine.step_registry import Step, StepRegistry, assign


@flax.struct.dataclass
class ForwardInputs:
    x: jax.Array


@flax.struct.dataclass
class Forward:
    logits: jax.Array


@flax.struct.dataclass
class SamplerInputs:
    logits: jax.Array | None  # a forward's, on the device: a leader does not send it
    weight: jax.Array


def registry(owner) -> StepRegistry:
    """A forward (logits = 2x) and a sampler that adds weight * sum(logits) to `owner.total`."""
    owner.total = jnp.zeros((), jnp.float32)
    steps = StepRegistry()
    steps.add([
        Step("forward", jax.jit(lambda inputs: (Forward(inputs.x * 2), ())), lambda: (), assign(owner),
             lambda: [ForwardInputs(np.zeros(3, np.float32))], forwards=("logits",)),
        Step("sample", jax.jit(lambda total, inputs: (None, (total + inputs.weight * inputs.logits.sum(),))),
             lambda: (owner.total,), assign(owner, "total"),
             lambda: [SamplerInputs(jnp.zeros(3, jnp.float32), np.float32(0))], forwarded=("logits",)),
    ])
    return steps


@pytest.fixture
def hosts():
    leader, follower = types.SimpleNamespace(), types.SimpleNamespace()
    leader.steps, follower.steps = registry(leader), registry(follower)
    frames = []
    leader.steps.on_call = lambda call: frames.append(encode_call(call))
    signatures = CallSignatures(follower.steps.sent_examples())

    def replay() -> None:
        for frame in frames:
            follower.steps.replay(signatures.decode(frame))
        frames.clear()

    return leader, follower, replay


def test_a_deferred_sampler_takes_its_own_forwards_logits_on_a_follower(hosts):
    leader, follower, replay = hosts
    first = leader.steps.run("forward", ForwardInputs(np.array([1, 2, 3], np.float32)), keep=("logits",))
    second = leader.steps.run("forward", ForwardInputs(np.array([10, 20, 30], np.float32)), keep=("logits",))
    leader.steps.run("sample", SamplerInputs(first.logits, np.float32(1)))  # after the second forward ran
    leader.steps.run("sample", SamplerInputs(second.logits, np.float32(100)))
    latest = leader.steps.run("forward", ForwardInputs(np.array([0, 0, 1], np.float32)))
    leader.steps.run("sample", SamplerInputs(latest.logits, np.float32(1000)))  # right after its forward
    replay()
    assert float(leader.total) == 12 + 120 * 100 + 2 * 1000
    assert float(follower.total) == float(leader.total)


def test_a_call_naming_an_output_the_follower_does_not_hold_is_refused(hosts):
    leader, follower, replay = hosts
    first = leader.steps.run("forward", ForwardInputs(np.ones(3, np.float32)), keep=("logits",))
    leader.steps.run("sample", SamplerInputs(first.logits, np.float32(1)))
    leader.steps._kept_ids[id(first.logits)] = 0  # as if kept again: the follower gave its copy to the sampler
    leader.steps.run("sample", SamplerInputs(first.logits, np.float32(1)))
    with pytest.raises(ValueError, match="kept by call 0, which this host does not hold"):
        replay()
