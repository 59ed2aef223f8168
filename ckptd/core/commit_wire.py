"""The COMMIT frame, the one frame that grows with the job, encoded and decoded with msgspec.

At 32,768 ranks a COMMIT carries every rank's record (rank_record.py): about 10 MB of JSON.
``json.dumps`` took 0.14 s to encode it on rank 0 and ``json.loads`` 0.46 s to decode it on the
daemon's event loop; msgspec encodes it in 16 ms and decodes it typed — each record a
``RecordWire``, its fields' types and entries' arity checked in the decode — in about a third of
that. Every other frame keeps framing.py's ``json`` (their floats may be NaN, which ``json`` writes
and msgspec would write as null; a COMMIT holds no floats). A COMMIT that does not decode as typed
is decoded as any frame is, so ``parse_request`` and ``parse_records`` name its fault as before.
"""
from __future__ import annotations

from typing import Any

import msgspec

from . import framing
from .gc_pause import gc_paused
from .rank_record import RecordWire

# How an encoded COMMIT starts: both encoders keep a dict's order, and ``protocol.to_wire`` puts "op" first.
COMMIT_PREFIX = b'{"op":"commit"'


class CommitWire(msgspec.Struct):
    """A COMMIT frame's fields as ``protocol.to_wire`` writes them; ``protocol.Commit``'s checks stay
    ``parse_request``'s (hence ``Any`` where it checks the type)."""
    op: str
    req: int
    step: Any
    digests: Any
    records: list[RecordWire] | None = None
    level: Any = "storage"
    check: Any = None


_DECODER = msgspec.json.Decoder(CommitWire)
_ENCODER = msgspec.json.Encoder()


def encode(msg: dict[str, Any]) -> bytes:
    """``framing.encode``, with msgspec for a COMMIT (its records as they are: JSON objects or typed)."""
    if msg.get("op") != "commit":
        return framing.encode(msg)
    return framing.frame(_ENCODER.encode(msg))


def decode_body(body: bytes) -> dict[str, Any]:
    """``framing.decode_body``, with a COMMIT's records decoded typed."""
    if body.startswith(COMMIT_PREFIX):
        try:
            with gc_paused():      # tens of thousands of records: see gc_pause
                c = _DECODER.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            return {f: getattr(c, f) for f in c.__struct_fields__}
    return framing.decode_body(body)
