"""zephon.torch: batches as tensors over the arrays' own memory, and the loader as a
torch.distributed.checkpoint Stateful: exact resume through DCP (one process, and two gloo
ranks restored on two and on one), through torch.save, and what it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.integration.corpus import lm_pipeline
from zephon.checkpoint.io import MAGIC
from zephon.checkpoint.layout import MERGED_FILE, SHARD_LANES, process_file
from zephon.errors import CheckpointError
from zephon.testing import assert_same_batches, take

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

import zephon.torch as zt  # noqa: E402

HERE = Path(__file__).parent
STEPS, CUT = 10, 4
# DCP says so on every call without a process group (these are one-process saves on purpose)
NO_PG = "ignore:torch.distributed is disabled"


def build(**kw):
    return lm_pipeline(seed=5, lanes=4, num_epochs=None, batch_size=2, output="lockstep", **kw)


def numpy_of(batch: dict) -> dict:
    return {k: v.numpy() for k, v in batch.items()}


@pytest.fixture(scope="module")
def reference():
    with build() as pipe:
        return take(pipe, STEPS)


# ------------------------------------------------------------------------------- batches


def test_a_batch_becomes_tensors_over_the_same_memory(reference):
    with build() as pipe:
        batch = next(pipe)
        tensors = zt.to_tensors(batch)
    assert sorted(tensors) == sorted(batch)
    for k, a in batch.items():
        t = tensors[k]
        assert isinstance(t, torch.Tensor)
        assert t.dtype == torch.int32 and tuple(t.shape) == a.shape == (8, 64)
        assert t.data_ptr() == a.ctypes.data  # no copy
        assert np.shares_memory(t.numpy(), a)
    with zt.Loader(build()) as loader:
        assert_same_batches(reference[:4], [numpy_of(b) for b in take(loader, 4)])


@pytest.mark.parametrize(
    "dtype, torch_dtype",
    [
        ("bool", "bool"), ("int8", "int8"), ("uint8", "uint8"), ("int16", "int16"),
        ("uint16", "uint16"), ("int32", "int32"), ("uint32", "uint32"), ("int64", "int64"),
        ("uint64", "uint64"), ("float16", "float16"), ("float32", "float32"),
        ("float64", "float64"), ("complex64", "complex64"), ("complex128", "complex128"),
    ],
)  # fmt: skip
def test_every_numeric_dtype_is_shared(dtype, torch_dtype):
    a = np.arange(12).reshape(3, 4).astype(dtype)
    t = zt.to_tensors({"x": a})["x"]
    assert t.dtype == getattr(torch, torch_dtype)
    assert np.shares_memory(t.numpy(), a)
    np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_ml_dtypes_become_torchs_own_over_the_same_bytes(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([0.5, -1.0, 2.0, 0.25], dtype=getattr(ml_dtypes, name))
    t = zt.to_tensors([a])[0]
    assert t.dtype == getattr(torch, name)
    assert t.data_ptr() == a.ctypes.data
    assert t.float().tolist() == a.astype(np.float32).tolist()


def test_layouts_torch_cannot_share_are_copied_and_other_values_kept():
    ro = np.arange(6, dtype=np.int64)
    ro.flags.writeable = False
    rev = np.arange(6, dtype=np.int64)[::-1]
    big = np.arange(6, dtype=">i4")
    strided = np.arange(12, dtype=np.int64)[::2]
    out = zt.to_tensors({"ro": ro, "rev": rev, "big": big, "strided": strided, "n": 3})
    for k in ("ro", "rev", "big"):
        assert out[k].tolist() == {"ro": ro, "rev": rev, "big": big}[k].tolist()
        assert out[k].data_ptr() != {"ro": ro, "rev": rev, "big": big}[k].ctypes.data
    assert out["big"].dtype == torch.int32
    assert np.shares_memory(out["strided"].numpy(), strided)  # positive strides: shared
    assert out["n"] == 3


@pytest.mark.parametrize("dtype", ["U4", "S4", "O", "datetime64[s]"])
def test_a_dtype_without_a_tensor_type_names_the_feature(dtype):
    batch = {"tokens": np.zeros(2, np.int32), "meta": {"id": np.zeros(2, dtype=dtype)}}
    with pytest.raises(TypeError, match=r"batch\['meta'\]\['id'\] is a numpy array of dtype"):
        zt.to_tensors(batch)


@pytest.mark.processes
def test_zero_copy_batches_are_ring_memory_and_resume_exactly(reference):
    # Views into the workers' rings: valid until the next next(), so the loop reads each
    # batch before asking for the next one (as a training step does).
    with zt.Loader(build(workers=2, zero_copy=True)) as loader:
        got = []
        for _ in range(CUT):
            t = next(loader)
            base = t["tokens"].numpy().base
            assert base is not None and not isinstance(base, np.ndarray)  # the slot itself
            got.append({k: v.numpy().copy() for k, v in t.items()})
        state = loader.state_dict()
    assert_same_batches(reference[:CUT], got)
    with zt.Loader(build(workers=2, zero_copy=True)) as again:
        again.load_state_dict(state)
        rest = [{k: v.numpy().copy() for k, v in next(again).items()} for _ in range(3)]
    assert_same_batches(reference[CUT : CUT + 3], rest)


# ---------------------------------------------------------------------------------- state


def _train_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.filterwarnings(NO_PG)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.processes)])
def test_dcp_saves_model_optimizer_and_loader_and_resumes_exactly(reference, tmp_path, workers):
    model, optim = _train_state(0)
    with zt.Loader(build(workers=workers)) as loader:
        head = [numpy_of(b) for b in take(loader, CUT)]
        dcp.save(
            {"model": model.state_dict(), "optim": optim.state_dict(), "loader": loader},
            checkpoint_id=tmp_path,
        )
    assert_same_batches(reference[:CUT], head)
    saved = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    entry = saved["loader." + MERGED_FILE]
    assert isinstance(entry, TensorStorageMetadata) and entry.properties.dtype == torch.uint8
    assert sorted(k for k in saved if k.startswith("loader.")) == ["loader." + MERGED_FILE]

    model2, optim2 = _train_state(1)
    with zt.Loader(build(workers=workers)) as fresh:
        state = {"model": model2.state_dict(), "optim": optim2.state_dict(), "loader": fresh}
        dcp.load(state, checkpoint_id=tmp_path, planner=zt.LoadPlanner())
        model2.load_state_dict(state["model"])
        rest = [numpy_of(b) for b in take(fresh, STEPS - CUT)]
    assert_same_batches(reference[CUT:], rest, f"workers={workers}")
    assert torch.equal(model2.weight, model.weight)


@pytest.mark.filterwarnings(NO_PG)
def test_dcp_without_the_planner_refuses_naming_the_loader_entry(tmp_path):
    with zt.Loader(build()) as loader:
        take(loader, CUT)
        dcp.save({"loader": loader}, checkpoint_id=tmp_path)
    with zt.Loader(build()) as fresh, pytest.raises(CheckpointException) as info:
        dcp.load({"loader": fresh}, checkpoint_id=tmp_path)
    assert "Size mismatch" in str(info.value) and "loader.loader.zph" in str(info.value)


@pytest.mark.filterwarnings(NO_PG)
def test_a_checkpoint_without_a_loader_is_named(tmp_path):
    dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=tmp_path)
    with zt.Loader(build()) as fresh, pytest.raises(CheckpointError, match="no Zephon loader"):
        dcp.load(
            {"loader": fresh},
            checkpoint_id=tmp_path,
            planner=zt.LoadPlanner(allow_partial_load=True),
        )
    with pytest.raises(ValueError, match="flatten_state_dict=True"):
        zt.LoadPlanner(flatten_state_dict=False)


def test_the_state_dict_through_torch_save_and_a_weights_only_load(reference, tmp_path):
    with zt.Loader(build()) as loader:
        take(loader, CUT)
        sd = loader.state_dict()
        assert sorted(sd) == [MERGED_FILE] and sd[MERGED_FILE].dtype == torch.uint8
        assert bytes(sd[MERGED_FILE][:8].tolist()) == MAGIC
        torch.save(sd, tmp_path / "loader.pt")
    with zt.Loader(build()) as fresh:
        fresh.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
        assert_same_batches(reference[CUT:], [numpy_of(b) for b in take(fresh, STEPS - CUT)])
    bad = {MERGED_FILE: torch.zeros(3, dtype=torch.float32)}
    with zt.Loader(build()) as fresh, pytest.raises(CheckpointError, match="1-D uint8"):
        fresh.load_state_dict(bad)


def test_each_rank_restores_its_own_torch_save(tmp_path):
    # Without DCP every rank saves and reads back its own file: its own lanes suffice.
    for r in range(2):
        with build(rank=r, world_size=2) as ref_rank:
            expected = take(ref_rank, STEPS)
        with zt.Loader(build(rank=r, world_size=2)) as loader:
            take(loader, CUT)
            sd = loader.state_dict()
        assert sorted(sd) == [process_file(r, 2)]
        with zt.Loader(build(rank=r, world_size=2)) as fresh:
            fresh.load_state_dict(sd)
            rest = [numpy_of(b) for b in take(fresh, STEPS - CUT)]
        assert_same_batches(expected[CUT:], rest, f"rank {r}")


class _Lanes:
    """A stand-in pipeline whose state has many lanes (a merged state of one rank)."""

    def __init__(self, lanes: list[int], state: dict | None = None) -> None:
        self.lanes = lanes
        self._state = state
        self.restored: dict | None = None

    def local_checkpoint(self) -> dict:
        if self._state is None:  # a fresh one, asked by dcp.load for its entries' shapes
            return {"format": "zephon.pipeline", "topology": {"rank": 1, "world_size": 8}}
        return self._state

    def restore(self, state: dict) -> None:
        self.restored = state

    def close(self) -> None:
        pass


@pytest.mark.filterwarnings(NO_PG)
def test_a_sharded_state_is_read_for_the_lanes_a_rank_owns(tmp_path):
    n = 2 * SHARD_LANES + 10
    state = {
        "format": "zephon.pipeline",
        "topology": {"rank": 0, "world_size": 1, "merged": True},
        "round_robin": {"dp_size": 1, "next_lanes": {"0": 0}},
        "lanes": [{"lane": lane, "cursor": [lane, 7], "blob": bytes(20)} for lane in range(n)],
    }
    dcp.save({"loader": zt.Loader(_Lanes(list(range(n)), state))}, checkpoint_id=tmp_path)
    saved = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert len([k for k in saved if k.startswith("loader.loader-lanes-")]) == 3
    mine = list(range(SHARD_LANES + 16, SHARD_LANES + 32))
    rank = _Lanes(mine)
    loader = zt.Loader(rank)
    planner = zt.LoadPlanner()
    dcp.load({"loader": loader}, checkpoint_id=tmp_path, planner=planner)
    assert rank.restored is not None
    assert [ls["lane"] for ls in rank.restored["lanes"]] == mine
    read = sorted(k for k in planner.state_dict if k.startswith("loader."))
    assert read == [
        f"loader.loader-lanes-{SHARD_LANES:06d}-{2 * SHARD_LANES - 1:06d}.zph",
        "loader." + MERGED_FILE,
    ]  # the index and the one shard holding these lanes


@pytest.mark.processes
def test_two_gloo_ranks_save_and_restore_on_two_and_on_one(reference, tmp_path):
    """Two processes (gloo over a FileStore) each save their own lanes with dcp.save,
    restore them with dcp.load (same layout); then this one process restores the
    two-rank checkpoint (merged)."""
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_torch_dcp_rank.py"), str(r), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only the processes this test started
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    ranks = []
    for r in range(2):
        with np.load(tmp_path / f"rank{r}.npz") as z:
            ranks.append([{k: z[f"{s}/{k}"] for k in reference[0]} for s in range(STEPS)])
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*ranks, strict=True)]
    assert_same_batches(reference, joined, "lockstep: rank 0's rows, then rank 1's")
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert sorted(k for k in saved if k.startswith("loader.")) == [
        "loader." + process_file(0, 2),
        "loader." + process_file(1, 2),
    ]
    with zt.Loader(build()) as whole, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"loader": whole}, checkpoint_id=tmp_path / "ckpt", planner=zt.LoadPlanner())
        rest = [numpy_of(b) for b in take(whole, STEPS - CUT)]
    assert_same_batches(reference[CUT:], rest, "the two-rank checkpoint on one rank")


def test_import_zephon_imports_neither_torch_nor_jax():
    code = (
        "import sys, zephon\n"
        "assert not {'torch', 'jax'} & set(sys.modules), 'import zephon imported them'\n"
        "import zephon.torch\n"
        "assert 'torch' in sys.modules and 'jax' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
