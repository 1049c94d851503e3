"""The one codec for every cross-process message: msgpack (msgspec), never pickle.

A message travels as two ZMQ frames: a 2-byte type tag from the explicit table below, and the
msgpack body; a `GenerateBatch` as its tag and then each request's body (so requests encoded
one by one are batched without encoding them again). Decoding looks the tag up in the table
(never in `globals()`), so a socket can only ever produce one of these types; a malformed body
raises `msgspec.ValidationError`.
"""

from __future__ import annotations

import msgspec

from braid.runtime.ipc.to_detokenizer import BatchTokenOut
from braid.runtime.ipc.to_scheduler import (
    AbortReq,
    ControlReq,
    GenerateBatch,
    GenerateReq,
    ShutdownReq,
)
from braid.runtime.ipc.to_tokenizer import (
    BatchStrOut,
    ControlOut,
    ProcessFailed,
    SchedulerHeartbeat,
    SchedulerReady,
)

# Tags are part of the wire format: append, never renumber.
MESSAGE_TYPES: dict[int, type] = {
    1: GenerateReq,
    2: AbortReq,
    3: ControlReq,
    4: ShutdownReq,
    5: BatchTokenOut,
    6: BatchStrOut,
    7: ControlOut,
    8: SchedulerReady,
    9: ProcessFailed,
    10: SchedulerHeartbeat,
    11: GenerateBatch,
}
_TAGS = {cls: tag for tag, cls in MESSAGE_TYPES.items()}
_BATCH_TAG = _TAGS[GenerateBatch]
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in MESSAGE_TYPES.items()}


def encode(msg: object) -> list[bytes]:
    if isinstance(msg, GenerateBatch):
        return batch_frames([_ENCODER.encode(r) for r in msg.reqs])
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message type")
    return [tag.to_bytes(2, "little"), _ENCODER.encode(msg)]


def batch_frames(bodies: list[bytes]) -> list[bytes]:
    """The frames of a `GenerateBatch` of these encoded `GenerateReq` bodies."""
    return [_BATCH_TAG.to_bytes(2, "little"), *bodies]


def decode(frames: list[bytes]) -> object:
    if len(frames) < 2 or len(frames[0]) != 2:
        raise ValueError("a message is a 2-byte tag and then its body")
    tag = int.from_bytes(frames[0], "little")
    if tag == _BATCH_TAG:
        return GenerateBatch([_DECODERS[1].decode(b) for b in frames[1:]])
    dec = _DECODERS.get(tag)
    if dec is None:
        raise ValueError(f"unknown message tag {tag}")
    if len(frames) != 2:
        raise ValueError("a message is exactly two frames: a 2-byte tag and a body")
    return dec.decode(frames[1])
