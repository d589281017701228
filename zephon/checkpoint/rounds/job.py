"""The job id: what tells the rounds of two jobs on one store location apart.

Every rank of a job must arrive at the same id on its own, before any round, so it comes
from what the launcher already gave every process of the job; the first source that is set
wins:

1. ``Pipeline(job_id=...)`` (``Aggregator(job_id=...)``), else ``ZEPHON_JOB_ID``: set one
   when nothing below applies, or to share a store location between jobs launched by hand;
2. ``TORCHELASTIC_RUN_ID``: torchrun's ``--rdzv-id`` (ignored when it is ``none``);
3. ``SLURM_JOB_ID`` (with ``SLURM_STEP_ID`` when set): Slurm's job, step by step;
4. ``PMIX_NAMESPACE``: the job of an MPI launcher using PMIx (Open MPI, Slurm's PMIx);
5. the ``jax.distributed`` coordinator address, when this process joined one (only looked
   up if JAX is already imported): two jobs that run at the same time cannot share one;
6. ``MASTER_ADDR:MASTER_PORT`` (torch.distributed's rendezvous), for the same reason;
7. none of these: the id ``"default"``. Ranks of one job still agree on it, but two such
   jobs with the same pipeline on one location are one job as far as the store can tell.
   They still never make a mixed state: every rank holds a liveness key for its place
   (``c.leader``, ``m.<rank>``; see :mod:`~zephon.checkpoint.rounds.holder`), so the
   second job's ranks whose places the first job's live processes hold are refused at
   once with an error naming ``job_id=``, and a round merges states of one step only, so
   lanes of two positions never meet. Give such jobs a ``job_id``.

Not chosen: agreeing on an id through the store at the first round. Two jobs that start at
once would each take the other's announcement for their own before any agreement, which is
exactly the mix-up a job id is there to prevent.

A job restarted under the same id (torchrun restarts, Slurm requeues) meets its own
leftovers, which the round tells apart by round id and session (see
``zephon.checkpoint.rounds``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["DEFAULT_JOB_ID", "resolve_job_id"]

DEFAULT_JOB_ID = "default"


def resolve_job_id(explicit: str | None = None) -> tuple[str, str]:
    """``(job id, where it came from)``, by the order of the module docstring.

    Raises:
        ValueError: ``explicit`` (or ``ZEPHON_JOB_ID``) is empty or longer than 200 chars.
    """
    if explicit is not None:
        return _checked(explicit, "job_id="), "job_id="
    env = os.environ
    if env.get("ZEPHON_JOB_ID") is not None:
        return _checked(env["ZEPHON_JOB_ID"], "ZEPHON_JOB_ID"), "ZEPHON_JOB_ID"
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id.lower() != "none":
        return f"torchelastic:{run_id}", "TORCHELASTIC_RUN_ID"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        job = env["SLURM_JOB_ID"] + (f".{step}" if step else "")
        return f"slurm:{job}", "SLURM_JOB_ID"
    if env.get("PMIX_NAMESPACE"):
        return f"pmix:{env['PMIX_NAMESPACE']}", "PMIX_NAMESPACE"
    coordinator = _jax_coordinator()
    if coordinator:
        return f"jax:{coordinator}", "jax.distributed coordinator"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"torch:{env['MASTER_ADDR']}:{env['MASTER_PORT']}", "MASTER_ADDR:MASTER_PORT"
    return DEFAULT_JOB_ID, "default (no launcher id found; set ZEPHON_JOB_ID)"


def _checked(job_id: str, where: str) -> str:
    if not isinstance(job_id, str) or not job_id or len(job_id) > 200:
        raise ValueError(f"{where} must be a non-empty str of at most 200 chars; got {job_id!r}")
    return job_id


def _jax_coordinator() -> str | None:
    if "jax" not in sys.modules:  # never import JAX for this
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = distributed.global_state
    if getattr(state, "client", None) is None:
        return None
    address = getattr(state, "coordinator_address", None)
    return str(address) if address else None
