"""Train a small decoder-only transformer on Python's help topics, fed by Zephon, kill it,
resume it, and get the same losses, float for float.

The data is the full Zephon chain over the text of ``pydoc_data.topics`` (ships with
CPython, no download): tokenize -> split -> pack -> shuffle -> ensure_mixture -> batch with
worker processes (:func:`zephon.demo.corpus.demo_pipeline`), turned into ``jax.Array``
global batches by :func:`zephon.jax.global_batches`. The model (2 pre-LN layers, 4 heads,
d_model 64, learned positions taken from the packer's ``tokens_positions``, attention
causal *and* within a packed segment) is plain ``jax.numpy``; optax's AdamW trains it.
Every ``--ckpt-every`` steps the model, the optimiser and the loader are saved together in
one Orbax ``CheckpointManager`` step.

::

    python -m zephon.demo.train_lm train --workdir runs/a --steps 200 --ckpt-every 25 --crash-at 130
    python -m zephon.demo.train_lm train --workdir runs/a --steps 200 --ckpt-every 25 --crash-at 130
    python -m zephon.demo.train_lm train --workdir runs/ref --steps 200 --ckpt-every 25
    python -m zephon.demo.train_lm compare runs/ref runs/a --plot losses.png
    python -m zephon.demo.train_lm demo            # all of the above, with a printed proof

``--crash-at STEP`` SIGKILLs the process when it reaches STEP (once per work directory: a
marker file remembers it), so the same command run again resumes from the last committed
checkpoint. Losses go to ``WORKDIR/losses.jsonl`` (:mod:`zephon.demo.losses`) as they are
computed, one line per step and attempt; a step recomputed after a resume appears twice
(attempt 0 and 1), and the trajectory is the last value per step. On the CPU backend the resumed trajectory equals
the uninterrupted one exactly: same float32 values, compared as floats, not within a
tolerance.

JAX is imported inside functions: the loader's worker processes are started with
``spawn`` and re-import this module, and they need no JAX.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zephon.demo.losses import (
    LOG,
    attempts,
    compare,
    plot_losses,
    read_log,
    trajectory,
    write_record,
)

CRASH_MARKER = "crashed"


@dataclass(frozen=True)
class Config:
    seq_len: int = 256
    batch_size: int = 8
    lanes: int = 4
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    mlp: int = 256
    vocab: int = 259  # zp.ByteTokenizer: pad 0, eos 1, unk 2, byte b -> b + 3
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0


# ------------------------------------------------------------------------------ the model


def make_model(cfg: Config) -> tuple[Any, Any]:
    """``(init(key) -> params, loss(params, batch) -> scalar)`` for ``cfg``."""
    import jax
    import jax.numpy as jnp

    head_dim = cfg.d_model // cfg.heads

    def init(key: Any) -> dict[str, Any]:
        keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))

        def dense(fan_in: int, fan_out: int) -> Any:
            return jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)

        d = cfg.d_model
        return {
            "embed": jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02,
            "pos": jax.random.normal(next(keys), (cfg.seq_len, d), jnp.float32) * 0.02,
            "layers": [
                {
                    "ln1": jnp.ones((d,), jnp.float32),
                    "qkv": dense(d, 3 * d),
                    "out": dense(d, d) / math.sqrt(2 * cfg.layers),
                    "ln2": jnp.ones((d,), jnp.float32),
                    "up": dense(d, cfg.mlp),
                    "down": dense(cfg.mlp, d) / math.sqrt(2 * cfg.layers),
                }
                for _ in range(cfg.layers)
            ],
            "ln_f": jnp.ones((d,), jnp.float32),
        }

    def norm(x: Any, scale: Any) -> Any:
        x = x - x.mean(-1, keepdims=True)
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale

    def attention(layer: dict[str, Any], x: Any, mask: Any) -> Any:
        b, t, d = x.shape
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, cfg.heads, head_dim) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        logits = jnp.where(mask[:, None], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d) @ layer["out"]

    def forward(params: dict[str, Any], tokens: Any, segments: Any, positions: Any) -> Any:
        t = tokens.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        # A token sees earlier tokens of its own packed document only (padding, segment 0,
        # sees padding: its rows are never in the loss, and softmax needs one key).
        mask = causal[None] & (segments[:, :, None] == segments[:, None, :])
        x = params["embed"][tokens] + params["pos"][positions]
        for layer in params["layers"]:
            x = x + attention(layer, norm(x, layer["ln1"]), mask)
            h = norm(x, layer["ln2"])
            x = x + jax.nn.gelu(h @ layer["up"]) @ layer["down"]
        return norm(x, params["ln_f"]) @ params["embed"].T

    def loss(params: dict[str, Any], batch: dict[str, Any]) -> Any:
        tokens, seg = batch["tokens"], batch["tokens_segment_ids"]
        logits = forward(params, tokens[:, :-1], seg[:, :-1], batch["tokens_positions"][:, :-1])
        targets = tokens[:, 1:]
        # Predict the next token of the same document; never across a packing boundary.
        weight = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return (nll * weight).sum() / jnp.maximum(weight.sum(), 1.0)

    return init, loss


# ------------------------------------------------------------------------------ training


def train(
    workdir: str | Path,
    steps: int,
    ckpt_every: int,
    workers: int = 2,
    crash_at: int | None = None,
    cfg: Config = Config(),  # noqa: B008 - frozen dataclass
) -> None:
    """Train for ``steps`` steps in ``workdir``, resuming from its last checkpoint."""
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    import zephon.jax as zj
    from zephon.demo.corpus import demo_pipeline

    t_start = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    crash_pending = crash_at is not None and not (workdir / CRASH_MARKER).exists()

    init, loss_fn = make_model(cfg)
    optimizer = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)

    @jax.jit
    def train_step(state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    params = init(jax.random.key(cfg.seed))
    state = {"params": params, "opt": optimizer.init(params)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    batches = zj.global_batches(
        demo_pipeline(
            seq_len=cfg.seq_len, batch_size=cfg.batch_size, lanes=cfg.lanes, workers=workers
        ),
        NamedSharding(mesh, PartitionSpec("data")),
        prefetch=2,
    )
    mngr = ocp.CheckpointManager(
        (workdir / "ckpt").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=3, cleanup_tmp_directories=True),
    )
    start = mngr.latest_step() or 0
    t_restore = time.perf_counter()
    if start:
        restored = mngr.restore(
            start,
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(state), loader=zj.CheckpointRestore(batches)
            ),
        )
        state = restored.model
    restore_s = time.perf_counter() - t_restore
    attempt = attempts(workdir / LOG)
    log = open(workdir / LOG, "a")  # noqa: SIM115 - closed at the end or by SIGKILL
    write_record(
        log,
        {
            "event": "start",
            "attempt": attempt,
            "from_step": start,
            "steps": steps,
            "ckpt_every": ckpt_every,
            "workers": workers,
            "config": asdict(cfg),
            "restore_s": restore_s if start else None,
        },
    )
    t_first = None
    with batches:
        for step in range(start, steps):
            if crash_pending and step == crash_at:
                # latest_step() counts a save whose async commit may still be running.
                write_record(
                    log,
                    {
                        "event": "crash",
                        "attempt": attempt,
                        "step": step,
                        "last_save_started": mngr.latest_step(),
                    },
                )
                (workdir / CRASH_MARKER).write_text(f"{step}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            state, loss = train_step(state, next(batches))
            loss = float(loss)  # float32 -> float64 is exact; JSON round-trips float64
            if t_first is None:
                t_first = time.perf_counter() - t_start
            write_record(log, {"attempt": attempt, "step": step, "loss": loss})
            done = step + 1
            if done % ckpt_every == 0 and done < steps:
                mngr.save(
                    done,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave(state), loader=zj.CheckpointSave(batches)
                    ),
                )
        mngr.wait_until_finished()
    mngr.close()
    write_record(
        log,
        {
            "event": "end",
            "attempt": attempt,
            "first_step_s": t_first,
            "total_s": time.perf_counter() - t_start,
        },
    )
    log.close()


# ------------------------------------------------------------------------------ the demo


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zephon.demo.train_lm", *args], text=True, capture_output=True
    )


def run_demo(
    workdir: str | Path,
    steps: int = 200,
    crash_at: int | None = None,
    workers: int = 2,
    ckpt_every: int = 25,
    out_png: str | Path | None = None,
) -> bool:
    """Uninterrupted run, crashed run (a subprocess SIGKILLed at ``crash_at``), resumed run
    (the same command again); compare the losses exactly, write the PNG, print the proof.

    Returns whether every loss matched.
    """
    import random

    workdir = Path(workdir)
    if crash_at is None:  # after the first checkpoint, when there is room for one
        crash_at = random.Random().randint(min(ckpt_every + 1, steps - 1), steps - 1)
    if not 0 < crash_at < steps:
        raise ValueError(f"crash_at must be in (0, steps={steps}); got {crash_at}")
    ref_dir, run_dir = workdir / "uninterrupted", workdir / "crash-and-resume"
    for d in (ref_dir, run_dir):
        if d.exists() and any(d.iterdir()):
            raise FileExistsError(f"{d} is not empty; give run_demo a fresh work directory")
    out_png = Path(out_png) if out_png is not None else workdir / "losses.png"
    common = [
        "train",
        "--steps",
        str(steps),
        "--ckpt-every",
        str(ckpt_every),
        "--workers",
        str(workers),
    ]
    print(
        f"train_lm demo: a {Config.layers}-layer transformer, {steps} steps of {Config.batch_size}x"
        f"{Config.seq_len} packed tokens of the pydoc topics corpus, loader workers={workers}, "
        f"model+loader saved with Orbax every {ckpt_every} steps, SIGKILL at step {crash_at}",
        flush=True,
    )

    t0 = time.perf_counter()
    ref = _run([*common, "--workdir", str(ref_dir)])
    _check(ref, "uninterrupted run")
    ref_s = time.perf_counter() - t0
    crashed = _run([*common, "--workdir", str(run_dir), "--crash-at", str(crash_at)])
    if crashed.returncode != -signal.SIGKILL:
        _check(crashed, "crashed run")
        raise RuntimeError(f"the crashed run exited with {crashed.returncode}, not SIGKILL")
    t1 = time.perf_counter()
    resumed = _run([*common, "--workdir", str(run_dir), "--crash-at", str(crash_at)])
    _check(resumed, "resumed run")
    resumed_s = time.perf_counter() - t1

    same, why = compare(ref_dir, run_dir)
    plot_losses(ref_dir, run_dir, out_png)
    records = read_log(run_dir / LOG)
    crash = next(r for r in records if r.get("event") == "crash")
    start = [r for r in records if r.get("event") == "start"][-1]
    end = next(r for r in read_log(ref_dir / LOG) if r.get("event") == "end")
    ref_losses = trajectory(ref_dir)
    redone = crash["step"] - start["from_step"]
    print(
        f"  uninterrupted run   {steps} steps in {ref_s:.1f} s (first step after {end['first_step_s']:.1f} s); "
        f"loss {ref_losses[0]:.3f} -> {ref_losses[steps - 1]:.3f}"
    )
    print(
        f"  crashed run         SIGKILL at step {crash['step']} (last save begun: step {crash['last_save_started']})"
    )
    print(
        f"  resumed run         same command again: restored model + optimiser + loader from the last "
        f"committed step, {start['from_step']}, in {start['restore_s'] or 0:.2f} s; "
        f"steps {start['from_step']}..{steps - 1} in {resumed_s:.1f} s"
    )
    print(f"  plot                {out_png}")
    if same:
        print(
            f"  PROOF: all {steps} losses identical to the uninterrupted run's (float32, exact), "
            f"including the {redone} steps recomputed between the checkpoint and the crash"
        )
    else:
        print(f"  FAILED: {why}", file=sys.stderr)
    return same


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} exited with {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )


# ------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (resuming from the work directory's last checkpoint)")
    t.add_argument("--workdir", required=True)
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--ckpt-every", type=int, default=25)
    t.add_argument("--workers", type=int, default=2, help="loader worker processes (0: none)")
    t.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process at STEP (once)")
    c = sub.add_parser("compare", help="compare two runs' losses exactly; optionally plot them")
    c.add_argument("ref", help="the uninterrupted run's work directory or losses.jsonl")
    c.add_argument("resumed", help="the crashed-and-resumed run's")
    c.add_argument("--plot", default=None, help="PNG overlaying the two loss curves")
    d = sub.add_parser("demo", help="uninterrupted, crashed and resumed runs; print the proof")
    d.add_argument("--workdir", default=None, help="default: a new temporary directory")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--ckpt-every", type=int, default=25)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--crash-at", type=int, default=None, help="default: random")
    d.add_argument("--plot", default=None, help="default: WORKDIR/losses.png")
    args = ap.parse_args(argv)

    if args.cmd == "train":
        for name in ("steps", "ckpt_every"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
        train(args.workdir, args.steps, args.ckpt_every, args.workers, args.crash_at)
        return 0
    if args.cmd == "compare":
        same, why = compare(args.ref, args.resumed)
        if args.plot:
            plot_losses(args.ref, args.resumed, args.plot)
        print("identical losses" if same else f"DIFFERENT: {why}")
        return 0 if same else 1
    workdir = args.workdir
    if workdir is None:
        import tempfile

        workdir = tempfile.mkdtemp(prefix="zephon-train-lm-")
    return (
        0
        if run_demo(workdir, args.steps, args.crash_at, args.workers, args.ckpt_every, args.plot)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
