"""CheckpointerConfig refuses bad values where it is built, naming the field: not at the first save,
in the daemon's hello, or in a relay thread that never ends."""
from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch
from ports import free_port
from torch.distributed import TCPStore

import ckptd_client
from ckptd.core.names import MAX_SLOTS
from ckptd_client.store_io import StoreWaiter

BAD: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"commit_timeout": float("nan")}, ValueError),
    ({"commit_timeout": float("inf")}, ValueError),
    ({"commit_timeout": 0}, ValueError),
    ({"commit_timeout": -1}, ValueError),
    ({"commit_timeout": "600"}, TypeError),
    ({"commit_timeout": True}, TypeError),
    ({"join_timeout": float("nan")}, ValueError),
    ({"join_timeout": -5.0}, ValueError),
    ({"join_timeout": "30"}, TypeError),
    ({"num_slots": 0}, ValueError),
    ({"num_slots": MAX_SLOTS + 1}, ValueError),
    ({"num_slots": "2"}, TypeError),
    ({"num_slots": 2.5}, TypeError),
    ({"num_slots": True}, TypeError),
    ({"rank": True}, TypeError),
    ({"rank": "0"}, TypeError),
    ({"rank": -1}, ValueError),
    ({"world_size": 1.0}, TypeError),
    ({"world_size": 0}, ValueError),
    ({"world_size": 10**9}, ValueError),
    ({"local_world_size": 0}, ValueError),
    ({"local_world_size": -3}, ValueError),
    ({"local_world_size": "8"}, TypeError),
    ({"restore_threads": 0}, ValueError),
    ({"restore_threads": -2}, ValueError),
    ({"restore_threads": 4.0}, TypeError),
    ({"memory": "no"}, TypeError),
    ({"prepare": 0}, TypeError),
    ({"spawn": "no"}, TypeError),
]


@pytest.mark.parametrize(("given", "error"), BAD, ids=[repr(g) for g, _ in BAD])
def test_a_bad_setting_is_refused_naming_its_field_and_value(given: dict[str, Any], error: type[Exception]) -> None:
    (field, value), = given.items()
    with pytest.raises(error) as got:
        ckptd_client.CheckpointerConfig(**given)
    text = str(got.value)
    assert field in text and repr(value) in text, text
    assert "must be" in text, text              # and what it takes


def test_rank_beyond_world_size_is_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        ckptd_client.CheckpointerConfig(rank=2, world_size=2)


def test_bad_keywords_fail_at_construction_before_the_daemon_is_asked(daemon_factory) -> None:
    d = daemon_factory()
    for kw in ({"num_slots": "2"}, {"rank": True, "world_size": 2, "commit": "local"}, {"world_size": 1.0}):
        with pytest.raises(TypeError, match=next(iter(kw))):
            ckptd_client.Checkpointer("cfg", socket=str(d.socket), **kw)
    good = ckptd_client.Checkpointer("cfg", socket=str(d.socket), rank=0, world_size=1, num_slots=MAX_SLOTS,
                                     commit_timeout=30, join_timeout=10.5, restore_threads=1, local_world_size=1)
    try:
        h = good.save(1, {"w": torch.ones(10)})
        h.wait(30)
        assert h.committed
    finally:
        good.close(timeout=10)


def test_a_store_wait_with_a_nan_timeout_raises_instead_of_spinning() -> None:
    store = TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    stop = threading.Event()
    waiter = StoreWaiter(store, stop)
    got: list[BaseException | bool] = []

    def wait() -> None:
        try:
            got.append(waiter.wait(["never-set"], math.nan))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(5)
    stop.set()                  # (ends a wait that spun)
    t.join(15)
    assert len(got) == 1 and isinstance(got[0], ValueError) and "finite" in str(got[0]), got
    t0 = time.monotonic()
    assert StoreWaiter(store).wait(["never-set"], 0.3) is False       # a finite one still waits and answers
    assert time.monotonic() - t0 >= 0.25


def test_numpy_scalars_are_taken_as_the_plain_numbers_they_are() -> None:
    """A value read from a NumPy array or a config library (np.float64, np.int64) worked before the
    fields were checked; it is taken, as a plain float or int, and a NumPy bool is still refused."""
    import numpy as np
    c = ckptd_client.CheckpointerConfig(commit_timeout=np.float64(600.0), join_timeout=np.int64(300),
                                        num_slots=np.int64(2), rank=np.int32(0), world_size=np.int64(2),
                                        restore_threads=np.uint8(3))
    assert (c.commit_timeout, c.join_timeout, c.num_slots, c.rank, c.world_size, c.restore_threads) == \
        (600.0, 300.0, 2, 0, 2, 3)
    assert [type(v) for v in (c.commit_timeout, c.join_timeout, c.num_slots, c.rank)] == [float, float, int, int]
    with pytest.raises(TypeError, match="commit_timeout must be a number of seconds"):
        ckptd_client.CheckpointerConfig(commit_timeout=np.bool_(True))   # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_slots must be an int"):
        ckptd_client.CheckpointerConfig(num_slots=np.float64(2.0))


def test_a_numpy_step_number_is_taken_and_a_bool_or_float_is_not(daemon) -> None:
    """A loop counting steps in NumPy (np.int64) had save(np.int64(7), …) refused: "step must be an
    integer …, got np.int64(7)". An integer type that says it is one is taken; bools and floats are not."""
    import numpy as np
    with ckptd_client.Checkpointer("np", socket=str(daemon.socket)) as ck:
        ck.save(np.int64(7), {"w": torch.full((4,), 7.0)}).wait(60)
        live = {"w": torch.zeros(4)}
        assert ck.restore(live, np.uint16(7)) == 7 and torch.equal(live["w"], torch.full((4,), 7.0))
        bad: Any
        for bad in (True, np.True_, 7.0, np.float64(8), torch.tensor(True), torch.tensor([7]), np.array(9)):
            with pytest.raises(ValueError, match="step must be an integer"):
                ck.save(bad, {"w": torch.zeros(4)})
    assert sorted(p.name for p in (daemon.root / "np").iterdir()) == ["step-000000000007"]


def test_a_socket_path_over_af_unix_s_limit_is_named_as_such() -> None:
    """A socket path over 107 bytes failed with "cannot reach the ckptd daemon … Start one with `ckptd serve
    … --socket <that same path>`", which no daemon can listen on either. It now says the path is too long."""
    ck = ckptd_client.Checkpointer("long", socket="/tmp/" + "s" * 120 + ".sock")
    with pytest.raises(ckptd_client.CheckpointError, match=r"is 130 bytes, over AF_UNIX's 107: give the daemon"):
        ck.save(1, {"w": torch.zeros(2)})
    ck.close()


def test_an_int_and_a_str_key_of_one_text_are_named_as_the_collision_they_are(daemon) -> None:
    """{1: t, "1": u} map to one tensor name; the error guessed "a key containing '/'", the wrong cause."""
    with ckptd_client.Checkpointer("keys", socket=str(daemon.socket)) as ck:
        with pytest.raises(ValueError, match="an int key and a str key of the same text"):
            ck.save(1, {"d": {1: torch.zeros(2), "1": torch.ones(2)}})
