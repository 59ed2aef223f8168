import torch

import ckptd_client


def test_save_restore_roundtrip(daemon):
    model = torch.nn.Linear(8, 4)
    ck = ckptd_client.Checkpointer("smoke", socket=str(daemon.socket))
    h = ck.save(1, {"model": model, "n": 7})
    h.wait(30)
    assert h.committed
    other = torch.nn.Linear(8, 4)
    state = {"model": other, "n": 0}
    assert ck.restore(state) == 1
    assert torch.equal(other.weight, model.weight) and state["n"] == 7
    ck.close()
    assert (daemon.root / "smoke" / "step-000000000001" / "index.json").is_file()
