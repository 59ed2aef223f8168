"""A COMMIT whose records would not fit one frame (16 MiB): the client finds out while encoding,
sends nothing of it, keeps its connection, and sends the COMMIT without the records (the daemon
then reads every manifest) — against a real daemon."""
from __future__ import annotations

from typing import Any

import pytest

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd_client.errors import DaemonRefused
from ckptd_client.session import DaemonSession

JOB = "frames"


def huge_records(world: int) -> list[dict[str, Any]]:
    """Records of ``world`` ranks over the frame limit in all (their content is never parsed)."""
    pad = "x" * (protocol.MAX_FRAME_BYTES // world + 1024)
    return [{"rank": r, "pad": pad} for r in range(world)]


def test_an_oversize_request_raises_before_sending_and_the_connection_stays_usable(daemon) -> None:
    session = DaemonSession(str(daemon.socket), JOB, 0, 2, 1, lambda op, msg: None, lambda why: None)
    conn = session.ensure_slots(4096)
    with pytest.raises(ProtocolError, match="exceeds the 16777216-byte frame limit"):
        conn.request(protocol.Commit(step=1, digests={}, records=huge_records(2)))
    assert not conn.lost
    # The next request is answered on the same connection: nothing of the refused one was sent.
    with pytest.raises(DaemonRefused, match="no relayed step 1 awaiting commit from rank 0 here"):
        conn.request(protocol.Commit(step=1, digests={}))
    session.drop()


def test_a_commit_over_the_frame_limit_is_sent_without_its_records(daemon) -> None:
    session = DaemonSession(str(daemon.socket), JOB, 0, 2, 1, lambda op, msg: None, lambda why: None)
    session.ensure_slots(4096)
    # Reaches the daemon (its own refusal: no step awaits a commit), not a ProtocolError here.
    with pytest.raises(DaemonRefused, match="no relayed step 1 awaiting commit from rank 0 here"):
        session.commit(1, {0: "sha256:" + "0" * 64, 1: "sha256:" + "1" * 64}, huge_records(2), 10.0, [0])
    assert session.conn is not None and not session.conn.lost
    session.drop()


GOOD = "sha256:" + "0" * 64


def test_a_commit_whose_digests_are_not_rank_numbers_to_digests_is_refused_before_its_step(daemon) -> None:
    """Every key a canonical rank number and every value a manifest digest, checked before the step
    is looked up: ``int()`` alone would take " 1", "1_0", "01" or "١" (two spellings of one rank
    collapsing into one entry) and a value that is not a digest used to be dropped silently. The
    connection stays usable, and a well-formed COMMIT goes on to the step's own check."""
    session = DaemonSession(str(daemon.socket), JOB, 0, 2, 1, lambda op, msg: None, lambda why: None)
    conn = session.ensure_slots(4096)
    bad: list[dict[str, Any]] = [
        {"01": GOOD}, {" 1": GOOD}, {"1 ": GOOD}, {"1_0": GOOD}, {"\u0661": GOOD}, {"+1": GOOD}, {"-1": GOOD},
        {"x": GOOD}, {"": GOOD}, {"0": GOOD, "1": None}, {"0": 5}, {"0": GOOD[:-1]}, {"0": GOOD + "0"},
        {"0": GOOD.upper()}, {"0": "sha512:" + "0" * 64}, {"0": GOOD, "00": GOOD},
    ]
    for digests in bad:
        with pytest.raises(DaemonRefused, match="digests must map rank numbers"):
            conn.request(protocol.Commit(step=1, digests=digests))
    for good in ({}, {"0": GOOD}, {"0": GOOD, "1": "sha256:" + "ab" * 32, "10": GOOD}):
        with pytest.raises(DaemonRefused, match="no relayed step 1 awaiting commit from rank 0 here"):
            conn.request(protocol.Commit(step=1, digests=good))
    assert not conn.lost
    session.drop()
