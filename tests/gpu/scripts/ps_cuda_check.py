"""Parameter-server mode with CUDA tensors on the workers (1 server, 1 worker here):
KVStore push/pull of CUDA tensors, and ps.DistributedOptimizer training a model on
CUDA, against the same training of a CPU copy with torch alone.  Prints
``ps cuda check ok`` on the worker when everything matches."""
from __future__ import annotations

import torch

import psrt.ps as ps
import psrt.torch as hvd


def main() -> None:
    hvd.init()
    kv = ps.KVStore("sync")
    kv.init("v", torch.arange(6, dtype=torch.float32, device="cuda"))
    pulled = kv.pull("v", out=torch.empty(6, device="cuda"))
    assert pulled.device.type == "cuda" and torch.equal(pulled.cpu(), torch.arange(6, dtype=torch.float32))
    kv.set_optimizer("SGD", lr=0.5)
    after = kv.push_pull("v", torch.ones(6, device="cuda"), torch.empty(6, device="cuda"))
    assert torch.equal(after.cpu(), torch.arange(6, dtype=torch.float32) - 0.5), after

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    reference.load_state_dict(model.state_dict())
    model.cuda()
    optimizer = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        model.named_parameters(), mode="sync")
    expected = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for net, opt, data in ((model, optimizer, x.cuda()), (reference, expected, x)):
            opt.zero_grad()
            net(data).square().mean().backward()
            opt.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.cpu(), want, msg=lambda m, n=name: f"{n}: {m}")
    print("ps cuda check ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
