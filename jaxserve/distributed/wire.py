"""The plan channel's messages, without pickles: a step call is the step's name, its inputs' tree structure and
their leaves (numpy arrays and scalars, or None for an input the follower holds itself), framed as a JSON header
followed by the arrays' raw bytes. A follower trusts nothing it reads: the step must be one of its own, the inputs'
structure, dtypes and shapes one of those its warm-up compiled for that step (`CallSignatures`), and the byte
counts exact; anything else is a `ValueError` naming what did not match.

    frame = u32 header length | header JSON | leaf bytes, in order
    header = {"step": NAME, "tree": TREEDEF, "leaves": [[DTYPE, SHAPE] | null, ...],
              "keep": [SERIAL, [FIELD, ...]] | null, "sources": {FIELD: SERIAL, ...}}  or  {"stop": STATUS}

`keep` asks the follower to keep some of the call's outputs under a serial; `sources` names, for an input left out,
the kept output it is (else it is the follower's latest output of that name): a sampler that waits for token
masks takes its own forward's logits, though other forwards ran since.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterable, NamedTuple

import jax
import numpy as np

LENGTH = struct.Struct("!I")
Signature = tuple[str, tuple[tuple[str, tuple[int, ...]] | None, ...]]


class Call(NamedTuple):
    """One step call as the plan channel carries it (`step` "stop": the leader's exit status in `inputs`)."""

    step: str
    inputs: Any
    keep: tuple[int, tuple[str, ...]] | None = None  # (serial, output fields) a later call takes
    sources: dict[str, int] = {}  # input field left out -> the serial of the kept output it is


def _is_none(leaf: Any) -> bool:
    return leaf is None


def _flatten(inputs: Any) -> tuple[list, Any]:
    return jax.tree.flatten(inputs, is_leaf=_is_none)


def _spec(leaf: Any) -> tuple[str, tuple[int, ...]] | None:
    if leaf is None:
        return None
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    return np.dtype(dtype).name, tuple(int(n) for n in np.shape(leaf))


def signature(inputs: Any) -> Signature:
    """What a follower checks a call's inputs against: their tree structure and each leaf's dtype and shape."""
    leaves, tree = _flatten(inputs)
    return str(tree), tuple(_spec(leaf) for leaf in leaves)


def _frame(header: dict, body: Iterable[bytes] = ()) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((LENGTH.pack(len(text)), text, *body))


def encode_call(call: Call) -> bytes:
    leaves, tree = _flatten(call.inputs)
    arrays = [None if leaf is None else np.asarray(leaf) for leaf in leaves]  # tobytes() is C order
    header = {"step": call.step, "tree": str(tree), "leaves": [_spec(array) for array in arrays],
              "keep": None if call.keep is None else [call.keep[0], list(call.keep[1])], "sources": call.sources}
    return _frame(header, (array.tobytes() for array in arrays if array is not None))


def encode_stop(status: int) -> bytes:
    return _frame({"stop": int(status)})


class CallSignatures:
    """Every (step, inputs signature) a follower may be asked to run, with the tree structure to rebuild the inputs
    with: from the examples its warm-up compiled, with the inputs a leader leaves out (None) as it leaves them."""

    def __init__(self, examples: Iterable[tuple[str, Any]]):
        self._trees: dict[tuple[str, Signature], Any] = {}
        for name, inputs in examples:
            self._trees[(name, signature(inputs))] = _flatten(inputs)[1]

    def tree(self, name: str, sig: Signature):
        tree = self._trees.get((name, sig))
        if tree is None:
            known = sorted({step for step, _ in self._trees})
            if name not in known:
                raise ValueError(f"unknown step {name!r} (this follower runs {known})")
            raise ValueError(f"step {name!r} was sent inputs of a structure or shape it has not compiled: {sig}")
        return tree

    def decode(self, frame: bytes) -> Call:
        """A step call, or `Call("stop", status)`; ValueError for a frame that is not one of these exactly."""
        if len(frame) < LENGTH.size:
            raise ValueError("truncated frame")
        (size,), offset = LENGTH.unpack_from(frame), LENGTH.size
        try:
            header = json.loads(frame[offset:offset + size])
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"the frame's header is not JSON: {error}") from None
        offset += size
        if not isinstance(header, dict):
            raise ValueError("the frame's header is not an object")
        if set(header) == {"stop"} and isinstance(header["stop"], int):
            if offset != len(frame):
                raise ValueError("a stop frame carries bytes after its header")
            return Call("stop", header["stop"])
        if set(header) != {"step", "tree", "leaves", "keep", "sources"} or not isinstance(header["leaves"], list):
            raise ValueError(f"the frame's header has keys {sorted(header)}")
        try:
            specs = tuple(None if spec is None else (str(spec[0]), tuple(int(n) for n in spec[1]))
                          for spec in header["leaves"])
        except (TypeError, ValueError, IndexError):
            raise ValueError("the frame's leaves are not [dtype, shape] pairs") from None
        name = header["step"]
        tree = self.tree(name, (header["tree"], specs))  # only dtypes and shapes compiled for this step pass
        leaves = []
        for spec in specs:
            if spec is None:
                leaves.append(None)
                continue
            dtype, shape = np.dtype(spec[0]), spec[1]
            end = offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            if end > len(frame):
                raise ValueError("the frame ends inside its arrays")
            leaves.append(np.frombuffer(frame, dtype, count=int(np.prod(shape, dtype=np.int64)),
                                        offset=offset).reshape(shape).copy())
            offset = end
        if offset != len(frame):
            raise ValueError(f"the frame has {len(frame) - offset} bytes after its arrays")
        inputs = jax.tree.unflatten(tree, leaves)
        return Call(name, inputs, _keep(header["keep"]), _sources(header["sources"], inputs))


def _keep(keep: Any) -> tuple[int, tuple[str, ...]] | None:
    if keep is None:
        return None
    if (isinstance(keep, list) and len(keep) == 2 and isinstance(keep[0], int) and isinstance(keep[1], list)
            and all(isinstance(field, str) for field in keep[1])):
        return keep[0], tuple(keep[1])
    raise ValueError(f"the frame's keep is not [serial, [field, ...]]: {keep!r}")


def _sources(sources: Any, inputs: Any) -> dict[str, int]:
    """Each source must name an input the leader left out (None)."""
    if not isinstance(sources, dict) or not all(isinstance(serial, int) for serial in sources.values()):
        raise ValueError(f"the frame's sources are not {{field: serial}}: {sources!r}")
    for field in sources:
        if getattr(inputs, field, 0) is not None:
            raise ValueError(f"the frame's source {field!r} is not an input left out")
    return sources
