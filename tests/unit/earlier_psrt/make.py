"""Writes the checkpoints in this folder with psrt as of commit ba57b04, the last whose files
were ``torch.save`` archives, so that tests/unit/test_checkpoint_formats.py can check that
they still load.  Run it with that psrt, from its checkout (it rewrites this folder)::

    git worktree add /tmp/psrt-ba57b04 ba57b04
    PYTHONPATH=/tmp/psrt-ba57b04 python tests/unit/earlier_psrt/make.py

Each checkpoint is of small objects built by :func:`objects` (shared with the test), one
step trained; ``expected.json`` holds what the test compares with.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def objects():
    """The model, its Adam optimizer after one step, and a parameter server's store."""
    from psrt.ps.protocol import Mode
    from psrt.ps.shard import ChunkMeta, Consistency, OptimizerSpec, Shard
    from psrt.ps.store import Store
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.arange(6.0).reshape(2, 3)).sum().backward()
    optimizer.step()
    store = Store((int(Mode.SYNC), 0, 0), Consistency(Mode.SYNC, 0, 1.0),
                  optimizer=OptimizerSpec("Adam", {"lr": 0.1, "betas": [0.9, 0.99]}))
    store.shards[0] = Shard(ChunkMeta(key="w", shape=(4,), dtype=torch.float32, offset=0, numel=4), 1,
                            store.consistency)
    store.shards[0].set_value(torch.arange(4.0))
    store.shards[0].set_optimizer(store.optimizer)
    buffer = store.shards[0].expect_push(0)
    buffer.fill_(1.0)
    store.shards[0].arrived(0, buffer)
    store.shards[0].apply_ready()
    return model, optimizer, store


def main() -> None:
    import psrt.torch as hvd
    from psrt.elastic import commits
    from psrt.ps import checkpoint as ps_checkpoint
    from psrt.zero import ZeroOptimizer
    for name in ("zero", "elastic", "ps"):
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
    os.environ[commits.ENV_DIR] = os.path.join(HERE, "elastic")
    hvd.init()
    model, optimizer, store = objects()
    state = hvd.elastic.TorchState(model, optimizer, epoch=3)
    state.commit()
    ps_checkpoint.write_manifest(os.path.join(HERE, "ps"), "id", 1, ps_checkpoint.save_server(
        os.path.join(HERE, "ps"), 0, 1, {0: store}, "id"))
    torch.manual_seed(0)
    zero_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    zero = ZeroOptimizer(zero_model, torch.optim.Adam, stage=2, lr=0.01)
    zero_model(torch.arange(6.0).reshape(2, 3)).sum().backward()
    zero.step()
    zero.save(os.path.join(HERE, "zero"), extra={"step": 1})
    expected = {"model": {k: v.tolist() for k, v in model.state_dict().items()},
                "exp_avg": optimizer.state_dict()["state"][0]["exp_avg"].tolist(),
                "zero_model": {k: v.tolist() for k, v in zero_model.state_dict().items()},
                "ps_value": store.shards[0].value.tolist()}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
