"""Training a Hugging Face model with psrt on TP 2 × PP 2, then using it with ``transformers`` alone.

Run with ``psrun -np 4 python examples/finetune_hf.py [DIRECTORY]`` (``make demo-hf``); needs
``pip install transformers``.  Nothing is downloaded: the model is a small ``LlamaForCausalLM``
built from a config.  ``tp.parallelize`` splits it over the two TP ranks of each stage,
``pp.split`` cuts it into two pipeline stages, and 1F1B runs 2 micro-batches per step.  The
task is to continue a repeating pattern: every sequence is a random 8-token pattern repeated,
so after its first period each next token can be copied from 8 positions back.  The loss is
taken only where the next token is predictable.  Rank 0 prints the loss every 10 steps.

``save_pretrained`` then writes an ordinary Hugging Face checkpoint from the shards (to
DIRECTORY, or a temporary directory that is deleted afterwards).  Rank 0 loads it in one
process with ``AutoModelForCausalLM.from_pretrained`` and continues new patterns with
``model.generate``.  It prints each prompt, the generated tokens, and how many of them
follow the pattern.
"""
from __future__ import annotations

import shutil
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import psrt.torch as hvd
from psrt import pp, tp
from psrt.grid import ProcessGrid
from psrt.pretrained import save_pretrained

VOCAB, PERIOD, LENGTH = 300, 8, 32     # token 0 is kept for bos/eos/padding
BATCH, MICROBATCHES, STEPS, LR = 64, 2, 100, 5e-3
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)


def patterns(rows: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` random patterns of PERIOD tokens, each repeated to LENGTH + 1 tokens."""
    pattern = torch.randint(1, VOCAB, (rows, PERIOD), generator=generator)
    return pattern.repeat(1, LENGTH // PERIOD + 1)[:, :LENGTH + 1]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))  # skips -100


def train(directory: str) -> None:
    grid = ProcessGrid(dp=1, tp=2, pp=2)
    torch.manual_seed(0)                    # every rank builds the same weights and keeps its part
    model = LlamaForCausalLM(CONFIG)
    tp.parallelize(model, grid.tp_set)
    stage = pp.split(model, grid.pp_set)
    pipeline = pp.Pipeline(stage, loss_fn, microbatches=MICROBATCHES, schedule="1f1b")
    named = list(stage.named_parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.AdamW([p for _, p in named], lr=LR), named_parameters=named,
                                         process_set=grid.dp_set, backward_passes_per_step=MICROBATCHES)
    generator = torch.Generator().manual_seed(1)  # the same batches on every rank
    for step in range(1, STEPS + 1):
        tokens = patterns(BATCH, generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        targets[:, :PERIOD - 1] = -100      # the first period is random: nothing to learn there
        loss = pipeline.step(inputs if grid.is_first_stage else None, targets if grid.is_last_stage else None)
        optimizer.step()
        optimizer.zero_grad()
        if hvd.rank() == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:3d}  loss {loss.item():.3f}", flush=True)
    save_pretrained(stage, directory, grid, config=model.config)


def generate(directory: str) -> None:
    """One process, no psrt: ``transformers`` loads the checkpoint and continues new patterns."""
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    new = patterns(3, torch.Generator().manual_seed(1234))
    prompt, expected = new[:, :PERIOD + 4], new[:, PERIOD + 4:PERIOD + 16]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=expected.shape[1], do_sample=False,
                             attention_mask=torch.ones_like(prompt), eos_token_id=None)
    generated = out[:, prompt.shape[1]:]
    for p, g, e in zip(prompt.tolist(), generated.tolist(), expected.tolist()):
        print(f"prompt {p}\n  generated {g}  ({sum(a == b for a, b in zip(g, e))}/{len(e)} follow the pattern)")
    right = (generated == expected).sum().item()
    print(f"from_pretrained + generate: {right}/{expected.numel()} generated tokens follow the pattern")


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)                # 4 ranks share the machine's cores
    given = sys.argv[1] if len(sys.argv) > 1 else None
    directory = given or hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-hf-") if hvd.rank() == 0 else None,
                                              root_rank=0, name="finetune_hf.directory")
    train(directory)
    if hvd.rank() == 0:
        print(f"saved to {directory}" if given else "saved to a temporary directory")
        generate(directory)
        if not given:
            shutil.rmtree(directory, ignore_errors=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
