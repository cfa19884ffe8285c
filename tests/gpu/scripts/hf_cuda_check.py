"""A model psrt did not write, split by ``tp.parallelize`` and ``pp.split`` over two
pipeline ranks with CUDA parameters, against the unsplit model in one process on the same
device (the Llama layout's rotary tables are float32 even in a float64 model, so the CPU
would differ by float32 rounding); and a checkpoint
written from the shards, loaded into a meta model straight onto the GPU and into a model
already there.  The model is a
``transformers`` Llama-layout model where ``transformers`` is installed, otherwise a plain
``nn.Module`` described by a plan and its named parts.  Prints ``hf cuda check ok``.
``--device cpu`` runs the same checks on the host."""
from __future__ import annotations

import shutil
import sys
import tempfile

import torch
from torch import nn

import psrt.torch as hvd
from psrt import pp, tp
from psrt.full_state import full_state_dict
from psrt.grid import ProcessGrid
from psrt.pretrained import load_pretrained, save_pretrained

VOCAB = 37


class Plain(nn.Module):
    """Embedding, residual MLP blocks, head: what a user's own decoder-like model may look like."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(meta: bool = False) -> tuple[nn.Module, dict]:
    """The model (float64, seed 0) and how to split it."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            plan = {"embed": tp.VocabEmbedding(), "blocks.*.0": tp.ColumnWise(), "blocks.*.2": tp.RowWise(),
                    "head": tp.ColumnWise(gather_output=True, pad=True)}
            return Plain().double(), {"plan": plan, "parts": dict(blocks="blocks", before=["embed"], after=["head"])}
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             bos_token_id=0, eos_token_id=0)
        return LlamaForCausalLM(config).double(), {"plan": "auto", "parts": {}}


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def main() -> None:
    hvd.init()
    on_cpu = "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu"
    if not on_cpu:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    grid = ProcessGrid(dp=1, tp=1, pp=hvd.size())
    reference, how = build()
    reference.to(device)
    model, _ = build()
    tp.parallelize(model, grid.tp_set, plan=how["plan"])
    stage = pp.split(model.to(device), grid.pp_set, **how["parts"])
    loss_fn = lambda logits, targets: nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    pipeline = pp.Pipeline(stage, loss_fn, microbatches=2)
    generator = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, VOCAB, (4, 8), generator=generator) for _ in range(2))
    loss = pipeline.step(ids.to(device) if grid.is_first_stage else None,
                         targets.to(device) if grid.is_last_stage else None)
    want = loss_fn(logits_of(reference, ids.to(device)), targets.to(device))
    want.backward()
    torch.testing.assert_close(loss.to(device), want.detach(), rtol=1e-10, atol=1e-12)
    grads = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        assert param.device.type == device.type, f"{name} left {device}"
    for name, value in stage.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and value.grad is not None:
            torch.testing.assert_close(value.grad, grads[name].grad, rtol=1e-10, atol=1e-12)
    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-hf-cuda-") if hvd.rank() == 0 else None,
                                     root_rank=0, name="hf_cuda.directory")
    try:
        save_pretrained(stage, directory, grid, config=getattr(model, "config", None))
        empty, _ = build(meta=True)
        tp.parallelize(empty, grid.tp_set, plan=how["plan"])
        again = pp.split(empty, grid.pp_set, **how["parts"])
        load_pretrained(again, directory, device=device)
        assert all(t.device.type == device.type for t in again.state_dict().values()), "a tensor left the device"
        full = full_state_dict(again, grid)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value.cpu(), rtol=0, atol=0)
        placed, _ = build()  # a model already on the device is overwritten in place
        tp.parallelize(placed, grid.tp_set, plan=how["plan"])
        there = pp.split(placed.to(device), grid.pp_set, **how["parts"])
        with torch.no_grad():
            for param in there.parameters():
                param.zero_()
        load_pretrained(there, directory)
        full = full_state_dict(there, grid)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value.cpu(), rtol=0, atol=0)
    finally:
        hvd.allgather_object(None, name="hf_cuda.done")
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if hvd.rank() == 0:
        print("hf cuda check ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
