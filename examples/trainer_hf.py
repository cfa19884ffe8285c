"""Training a Hugging Face model with transformers' ``Trainer`` on psrt's ``torch.distributed`` backend.

Run with ``psrun -np 2 python examples/trainer_hf.py [--backend gloo] [--steps N]`` (``plain
mpirun`` and ``srun`` work too); needs ``pip install transformers accelerate``.  Nothing is
downloaded: the model is a small ``GPT2LMHeadModel`` built from a config, and the data are
made here, as in ``finetune_hf.py``: every sequence is a random 8-token pattern repeated, and
the loss is taken where the next token can be copied from 8 positions back.

The one change a ``Trainer`` script needs is to start torch's default group on psrt before it
makes its ``TrainingArguments``: transformers' ``ddp_backend`` only takes names of its own, and
accelerate, which the ``Trainer`` runs on, uses the group that exists.  accelerate finds each
process's place in torchrun's variables (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``), which psrun
sets for every rank (``import psrt.torch`` does under other launchers).  The ``Trainer`` then
wraps the model in ``DistributedDataParallel`` and gives each rank its share of every batch,
as under torchrun.  ``--backend gloo`` runs the same training on torch's gloo backend:
its final parameters equal psrt's (tests/parallel/scripts/torch_backend_check.py checks that).

Rank 0 prints the loss every 10 steps and what share of the predictable tokens the trained
model continues right.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import psrt.torch  # noqa: F401  (registers the "psrt" backend; sets LOCAL_RANK and the rest if missing)

VOCAB, PERIOD, LENGTH, ROWS = 64, 8, 32, 512     # token 0 is kept for bos/eos
CONFIG = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def patterns(rows: int, seed: int) -> torch.Tensor:
    """``rows`` random patterns of PERIOD tokens, each repeated to LENGTH tokens."""
    pattern = torch.randint(1, VOCAB, (rows, PERIOD), generator=torch.Generator().manual_seed(seed))
    return pattern.repeat(1, LENGTH // PERIOD)


def dataset(rows: int = ROWS, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The training rows, the same on every rank (the ``Trainer`` gives each rank its share):
    the model's inputs, and labels that leave out the first period (nothing to copy from)."""
    rows_of_tokens = patterns(rows, seed)
    labels = rows_of_tokens.clone()
    labels[:, :PERIOD] = -100
    return [{"input_ids": tokens, "labels": label} for tokens, label in zip(rows_of_tokens, labels)]


def model() -> GPT2LMHeadModel:
    """The model every rank starts from: the same weights everywhere."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def train(steps: int, output_dir: str, batch_size: int = 8) -> Trainer:
    """Train a fresh model for ``steps`` steps with the ``Trainer`` on torch's default group,
    which the caller has started (on psrt or another backend); returns the ``Trainer``, whose
    ``model`` is the trained model.

    Collective: every rank of the default group calls it, in the same order.
    """
    arguments = TrainingArguments(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=batch_size, max_steps=steps,
        learning_rate=1e-2, warmup_steps=0, seed=0, data_seed=0, logging_steps=10, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False)
    trainer = Trainer(model=model(), args=arguments, train_dataset=dataset())
    trainer.train()
    return trainer


def accuracy(trained: GPT2LMHeadModel) -> float:
    """The share of predictable tokens of new patterns that the model's greedy choice gets right."""
    rows = dataset(64, seed=1)
    inputs = torch.stack([row["input_ids"] for row in rows])
    labels = torch.stack([row["labels"] for row in rows])
    with torch.no_grad():
        predicted = trained(input_ids=inputs).logits[:, :-1].argmax(dim=-1)
    wanted = labels[:, 1:] != -100
    return (predicted[wanted] == labels[:, 1:][wanted]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="psrt", help="torch.distributed backend (default: psrt)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    dist.init_process_group(args.backend)   # before TrainingArguments, which starts accelerate
    with tempfile.TemporaryDirectory() as output_dir:
        trained = train(args.steps, output_dir).model
    if dist.get_rank() == 0:
        print(f"{args.backend}: {dist.get_world_size()} ranks, {args.steps} steps; the trained model continues "
              f"{accuracy(trained):.0%} of new patterns' predictable tokens right", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
