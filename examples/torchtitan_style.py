"""A torchtitan-style training loop on Zephon: the data through ``zephon.torch``, model,
optimizer, train state and loader saved together with ``torch.distributed.checkpoint``
(DCP) every K steps, and a restarted job that resumes from the last checkpoint with the
same batches, so the same losses, bit for bit.

    python examples/torchtitan_style.py --workdir /tmp/tt --steps 40 --checkpoint-every 10
    python examples/torchtitan_style.py --workdir /tmp/tt2 --steps 40 --crash-at 25
    python examples/torchtitan_style.py --workdir /tmp/tt2 --steps 40   # resumes at 20

Each step's loss is printed and appended to ``WORKDIR/losses.jsonl``; compare the two
runs' steps 21..40. Under ``torchrun --nproc-per-node N`` every rank reads its own lanes
(``rank``/``world_size`` from the process group), the model is wrapped in DDP, and DCP
saves every rank's loader state under its own key.

What is torchtitan's here: the checkpoint holds ``model``, ``optimizer``, ``train_state``
and ``dataloader`` entries, each a DCP ``Stateful`` (model and optimizer through
``torch.distributed.checkpoint.state_dict``, as its ``ModelWrapper`` and
``OptimizersContainer`` do), saved to ``step-<N>`` directories; a restart loads the newest
complete one (DCP writes its ``.metadata`` last). What Zephon adds: the dataloader entry is
the pipeline's exact position, in Zephon's format (uint8 tensors of msgpack + zstd, not a
pickle), restored with ``planner=zephon.torch.LoadPlanner()``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

import zephon as zp

SEQ_LEN = 64
BATCH_PER_LANE = 2
LANES = 4
IGNORE = -100

# torch is imported inside the functions below, not here: the pipeline's worker processes
# start by importing this file again (spawn), and need none of it.


def corpus(docs: int = 600, seed: int = 0) -> list[str]:
    """Deterministic documents of varied length (a real job reads files: JsonlSource,
    ParquetSource, TokenFileSource, ...)."""
    rng = np.random.default_rng(seed)
    words = ["the", "loader", "resumes", "exactly", "every", "batch", "step", "rank", "lane"]
    return [" ".join(rng.choice(words, int(rng.integers(3, 60)))) for _ in range(docs)]


def build(rank: int, world_size: int, workers: int) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(corpus())], seed=0, chunk_size=16, num_epochs=None
    )
    return (
        zp.Pipeline(
            src, canonical_replicas=LANES, rank=rank, world_size=world_size, workers=workers
        )
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=SEQ_LEN)
        .pack(SEQ_LEN, num_bins=4)
        .shuffle(buffer_size=8, seed=1)
        .lm_targets(ignore_id=IGNORE)
        .batch(BATCH_PER_LANE)
    )


def make_model() -> Any:
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self, vocab: int = zp.ByteTokenizer.vocab_size, dim: int = 32) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.mix = torch.nn.Linear(dim, dim)
            self.out = torch.nn.Linear(dim, vocab)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.mix(self.embed(inputs))))

    return TinyLM()


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.stateful import Stateful

    import zephon.torch as zt

    class ModelWrapper(Stateful):
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def state_dict(self) -> dict[str, Any]:
            return get_model_state_dict(self.model)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_model_state_dict(self.model, state_dict)

    class OptimizerWrapper(Stateful):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            self.model, self.optimizer = model, optimizer

        def state_dict(self) -> dict[str, Any]:
            return get_optimizer_state_dict(self.model, self.optimizer)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_optimizer_state_dict(self.model, self.optimizer, state_dict)

    class TrainState(Stateful):
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": torch.tensor(self.step)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step = int(state_dict["step"])

    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # one process: a group of one, as torchtitan always has one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same reductions in the same order: bit-identical losses

    model = make_model()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_state = TrainState()
    loader = zt.Loader(build(rank, world, args.workers))
    states = {
        "model": ModelWrapper(model),
        "optimizer": OptimizerWrapper(model, optimizer),
        "train_state": train_state,
        "dataloader": loader,
    }

    ckpt_dir = args.workdir / "checkpoint"
    done = sorted(
        (int(p.name.split("-")[1]) for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists()),
    )
    if done:
        dcp.load(states, checkpoint_id=ckpt_dir / f"step-{done[-1]}", planner=zt.LoadPlanner())
        if rank == 0:
            print(f"resumed from step {train_state.step}", flush=True)

    log = open(args.workdir / "losses.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    try:
        while train_state.step < args.steps:
            batch = next(loader)  # {"inputs", "targets", ...}: int32 tensors, no copy
            logits = model(batch["inputs"].long())
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["targets"].long().flatten(), ignore_index=IGNORE
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            train_state.step += 1
            step = train_state.step
            if log is not None:
                print(f"step {step:4d}  loss {loss.item():.6f}", flush=True)
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                log.flush()
            if step % args.checkpoint_every == 0:
                dcp.save(states, checkpoint_id=ckpt_dir / f"step-{step}")
            if step == args.crash_at:
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: a crash
    finally:
        if log is not None:
            log.close()
        loader.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--crash-at", type=int, help="die (SIGKILL) right after this step")
    ap.add_argument("--workers", type=int, default=2, help="Zephon worker processes")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
