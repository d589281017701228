"""``Pipeline(workers=zp.RayWorkers(...))``: what the Ray executor is asked for, and how a
local Ray is started without leaving this machine.

Nothing here imports Ray: :class:`RayWorkers` is checked where the pipeline is built, and
Ray is imported when the pipeline first runs (:mod:`zephon.runners.ray`).

A local start (:func:`start_local_ray`, and ``RayWorkers(address=None)`` when this process
is not connected to Ray yet) keeps Ray on the loopback interface and off the network. With
its defaults Ray binds to the machine's external address and, even with usage stats off,
its dashboard asks cloud metadata addresses (HTTP to 169.254.169.254) what it runs on. So:

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-node (laptop) mode, which takes
  127.0.0.1 as the node's address (read when ``ray`` is first imported: for a ``ray``
  imported before, the constant it set is set too), and ``_node_ip_address="127.0.0.1"``;
* ``RAY_USAGE_STATS_ENABLED=0``;
* an empty ``ray_bootstrap_config.yaml`` in the ``HOME`` the Ray processes see (a private
  directory, :func:`ray_home`): Ray then reads its cluster config from it instead of
  probing metadata addresses;
* ``include_dashboard=False`` and a small ``num_cpus``.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: How long joining ``RayWorkers(address=...)`` may take before it is an error naming the
#: address (a TCP connection to it first, then Ray's own connection).
CONNECT_TIMEOUT_S = 10.0

#: How many times in a row a lane may move because its actor died (see
#: ``RayWorkers(max_lane_restarts=...)``). Ray retries a task whose
#: worker died 3 times by default (``max_retries``); its actors and torchrun's worker
#: groups restart 0 times by default, but here restarting is what keeps batches exact.
MAX_LANE_RESTARTS = 3

#: The environment of a local Ray start (see the module's docstring).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}
LOOPBACK_IP = "127.0.0.1"


@dataclass(frozen=True)
class RayWorkers:
    """Run this rank's lanes on Ray actors: ``Pipeline(workers=zp.RayWorkers(2))``.

    The pipeline's process keeps the work sources, in-flight chunks, completion tracking
    and replay cursors, exactly as with local worker processes; each actor runs the same
    plan over the lanes it owns and returns their batches through Ray's object store. The
    batches are those of ``workers=0``, bit for bit, and a checkpoint restores into any
    executor. An actor that dies gives its lanes to the others, which replay their
    in-flight chunks: no batch changes; a new actor is asked for in its place. A lane
    whose actors keep dying before it gets past its chunks (a sample that crashes its
    process) ends the run with an error instead (``max_lane_restarts``).

    Args:
        num_workers: actors for this rank (at most one per lane is used). The pipeline
            starts once one is up (none within ``worker_timeout_s`` is an error naming the
            resources asked and available) with those up then or within a second; the
            others join when Ray places them (a node added, e.g. by its autoscaler) and
            take lanes from the most loaded actors.
        address: ``None``: the Ray this process is connected to, else a local one started
            on 127.0.0.1 (see :func:`start_local_ray`); an address (``"host:6379"``,
            ``"ray://host:10001"``): join that cluster, an error naming it after
            ``connect_timeout_s`` if it cannot be reached.
        resources: what each actor asks of Ray, e.g. ``{"CPU": 2, "memory": 2**30}`` or a
            custom resource; ``CPU`` and ``GPU`` are Ray's ``num_cpus`` and ``num_gpus``.
            ``None``: ``{"CPU": 1}``.
        speculate: run a lane that falls behind on a second actor too: when this process
            has waited for a lane's next output longer than ``straggler_factor`` times
            the median lane's recent wait (and at least ``straggler_min_s``; once half the
            lanes have had an output), the lane starts again on the least loaded other
            actor from its in-flight chunks (the path of a lane move); whichever actor makes the lane's next output first keeps
            the lane, the other drops it. A lane's outputs are a pure function of its
            chunks, so the duplicate changes nothing. ``stats()["ray"]`` counts
            ``speculations`` and ``speculation_wins`` (the copy was first).
        straggler_factor: the ``k`` above (> 0).
        straggler_min_s: the shortest wait that counts as falling behind (>= 0): a
            pipeline whose outputs are all ready waits about nothing, and a lane is not a
            straggler for a few milliseconds of that.
        connect_timeout_s: see ``address``.
        max_lane_restarts: how many times in a row a lane may move to another actor
            because the actor running it died (an int >= 0; ``None``: no limit). Deaths
            are in a row while the lane has not got past the chunks it had at the one
            before: one of them is still in flight. The next death is a
            :class:`~zephon.errors.WorkerError` naming the lane, its deaths and the last
            one's cause as Ray reports it: a sample whose processing kills its process (a
            segfault in a native function, ``os._exit``, memory exhausted on one sample)
            keeps its chunk in flight and would otherwise kill every actor the lane moves
            to, one after another, forever. Deaths spread over a run (nodes lost now and
            then) do not add up: the lane's chunks move on in between. The default, 3, is
            Ray's default ``max_retries`` for a task whose worker died.
    """

    num_workers: int
    address: str | None = None
    resources: Mapping[str, float] | None = None
    speculate: bool = True
    straggler_factor: float = 4.0
    straggler_min_s: float = 0.25
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    max_lane_restarts: int | None = MAX_LANE_RESTARTS
    _resources: tuple[tuple[str, float], ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_workers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"RayWorkers(num_workers=...) must be an int >= 1; got {n!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ValueError(
                f"RayWorkers(address=...) must be None (a local Ray) or a non-empty str such "
                f"as 'host:6379' or 'ray://host:10001'; got {self.address!r}"
            )
        res = {"CPU": 1.0} if self.resources is None else self.resources
        if not isinstance(res, Mapping) or not all(
            isinstance(k, str)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
            for k, v in res.items()
        ):
            raise ValueError(
                "RayWorkers(resources=...) must map resource names to numbers >= 0 (e.g. "
                f"{{'CPU': 1}}); got {self.resources!r}"
            )
        if not isinstance(self.speculate, bool):
            raise ValueError(f"RayWorkers(speculate=...) must be a bool; got {self.speculate!r}")
        k = self.straggler_factor
        if not (isinstance(k, (int, float)) and not isinstance(k, bool) and k > 0):
            raise ValueError(f"RayWorkers(straggler_factor=...) must be > 0; got {k!r}")
        m = self.straggler_min_s
        if not (isinstance(m, (int, float)) and not isinstance(m, bool) and m >= 0):
            raise ValueError(f"RayWorkers(straggler_min_s=...) must be >= 0; got {m!r}")
        t = self.connect_timeout_s
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0):
            raise ValueError(f"RayWorkers(connect_timeout_s=...) must be > 0; got {t!r}")
        r = self.max_lane_restarts
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(
                f"RayWorkers(max_lane_restarts=...) must be an int >= 0 or None (no limit); "
                f"got {r!r}"
            )
        object.__setattr__(self, "_resources", tuple(sorted((k, float(v)) for k, v in res.items())))

    def actor_options(self) -> dict[str, Any]:
        """The resources of one actor as Ray's ``.options(...)`` takes them."""
        res = dict(self._resources)
        opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0.0)}
        if "GPU" in res:
            opts["num_gpus"] = res.pop("GPU")
        if "memory" in res:
            opts["memory"] = res.pop("memory")
        if res:
            opts["resources"] = res
        return opts


def ray_home() -> str:
    """A private ``HOME`` for local Ray processes, holding an empty
    ``ray_bootstrap_config.yaml`` (see the module's docstring)."""
    home = os.path.join(tempfile.gettempdir(), f"zephon-ray-home-{os.getuid()}")
    os.makedirs(home, mode=0o700, exist_ok=True)
    cfg = os.path.join(home, "ray_bootstrap_config.yaml")
    if not os.path.exists(cfg):
        open(cfg, "w").close()
    return home


def start_local_ray(num_cpus: int = 2, **init_kw: Any) -> Any:
    """Starts a Ray instance on this machine only (127.0.0.1, no dashboard, no usage
    stats, no metadata probes); what ``ray.init`` returns. ``init_kw`` go to ``ray.init``
    (e.g. ``object_store_memory``). The Ray processes inherit this process's environment
    as it is during the call: the loopback settings are set in it for good, ``HOME`` only
    while they start."""
    os.environ.update(LOOPBACK_ENV)  # before Ray is imported: it reads them then
    import ray
    from ray._private import ray_constants

    # A Ray imported before read the single-node switch already: set what it read.
    ray_constants.ENABLE_RAY_CLUSTER = False

    kw: dict[str, Any] = {
        "address": "local",
        "include_dashboard": False,
        "num_cpus": num_cpus,
        "_node_ip_address": LOOPBACK_IP,
        "log_to_driver": False,
        "configure_logging": False,
    }
    kw.update(init_kw)
    old = os.environ.get("HOME")
    os.environ["HOME"] = ray_home()
    try:
        return ray.init(**kw)
    finally:
        if old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old


def check_reachable(address: str, timeout_s: float) -> None:
    """A TCP connection to ``address`` (``host:port``, maybe ``ray://``) within
    ``timeout_s``, or a ConnectionError naming it; ``"auto"`` is left to Ray."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"RayWorkers(address={address!r}): expected 'host:port' or 'ray://host:port'"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(
            f"RayWorkers(address={address!r}): the Ray cluster cannot be reached ({e}) within "
            f"connect_timeout_s={timeout_s}; start it (ray start --head) or fix the address"
        ) from e
