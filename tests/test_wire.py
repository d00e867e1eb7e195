"""The plan channel's frames: a follower rebuilds exactly what the leader sent, and refuses anything that is not a
call it compiled (no pickles: a frame is a JSON header and raw array bytes)."""

import pickle

import flax
import jax
import numpy as np
import pytest

from jaxserve.distributed.wire import Call, CallSignatures, encode_call, encode_stop


@flax.struct.dataclass
class Inputs:
    slots: jax.Array
    tokens: jax.Array
    logits: jax.Array | None  # an earlier call's output the follower holds itself


def example(rows: int, logits=None) -> Inputs:
    return Inputs(slots=np.zeros(rows, np.int32), tokens=np.zeros((rows, 8), np.int32), logits=logits)


@pytest.fixture
def signatures() -> CallSignatures:
    return CallSignatures([("decode", example(1)), ("decode", example(4)), ("table", (np.zeros(3, np.float32),)),
                           ("reset", (np.int32(0), np.zeros(16, np.int32)))])


def test_a_call_round_trips_exactly(signatures):
    sent = Inputs(slots=np.arange(4, dtype=np.int32), tokens=np.arange(32, dtype=np.int32).reshape(4, 8), logits=None)
    name, got, keep, sources = signatures.decode(encode_call(Call("decode", sent, (7, ("logits",)), {"logits": 3})))
    assert name == "decode" and isinstance(got, Inputs) and got.logits is None
    assert keep == (7, ("logits",)) and sources == {"logits": 3}
    np.testing.assert_array_equal(got.slots, sent.slots)
    np.testing.assert_array_equal(got.tokens, sent.tokens)
    assert got.tokens.dtype == np.int32 and got.tokens.flags.writeable
    name, (table,), keep, sources = signatures.decode(encode_call(Call("table", (np.ones(3, np.float32),))))
    assert name == "table" and table.tolist() == [1.0, 1.0, 1.0] and keep is None and sources == {}
    name, (slot, ids), _, _ = signatures.decode(encode_call(Call("reset", (np.int32(5), np.arange(16, dtype=np.int32)))))
    assert name == "reset" and slot.shape == () and slot.dtype == np.int32 and int(slot) == 5
    transposed = np.arange(32, dtype=np.int32).reshape(8, 4).T  # not C-contiguous: sent in its logical order
    got = signatures.decode(encode_call(Call("decode", Inputs(np.zeros(4, np.int32), transposed, None)))).inputs
    np.testing.assert_array_equal(got.tokens, transposed)
    assert signatures.decode(encode_stop(3))[:2] == ("stop", 3)


@pytest.mark.parametrize("name, inputs, message", [
    ("prefill", example(4), "unknown step 'prefill'"),
    ("decode", example(2), "has not compiled"),  # a shape warm-up did not compile
    ("decode", Inputs(np.zeros(4, np.int64), np.zeros((4, 8), np.int32), None), "has not compiled"),  # a dtype
    ("decode", (np.zeros(4, np.int32), np.zeros((4, 8), np.int32), None), "has not compiled"),  # a structure
    ("decode", example(4, logits=np.zeros((4, 5), np.float32)), "has not compiled"),  # an input it holds itself
])
def test_a_call_it_did_not_compile_is_refused(signatures, name, inputs, message):
    with pytest.raises(ValueError, match=message):
        signatures.decode(encode_call(Call(name, inputs)))


def test_malformed_frames_are_refused(signatures):
    frame = encode_call(Call("decode", example(4)))
    for bad, message in [(frame[:-1], "ends inside its arrays"), (frame + b"\0", "bytes after its arrays"),
                         (frame[:2], "truncated"), (encode_stop(0) + b"x", "after its header"),
                         (pickle.dumps(("decode", example(4))), "not JSON|truncated|header"),
                         (encode_call(Call("decode", example(4), sources={"slots": 1})), "not an input left out"),
                         (encode_call(Call("decode", example(4), keep=("1", ("logits",)))), "keep is not")]:
        with pytest.raises(ValueError, match=message):
            signatures.decode(bad)
