"""What the metrics are shown as: ``zp.metrics.record`` writing a series during a run with
worker processes, ``zephon report`` drawing it as a PNG, ``zephon top`` read back from a
pseudo-terminal against the endpoint of a running pipeline."""

from __future__ import annotations

import gc
import os
import pty
import re
import select
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import zephon as zp
from zephon.cli.main import main
from zephon.metrics import series as series_module
from zephon.metrics.view import canonical, frame, parse_text

pytestmark = [
    pytest.mark.processes,
    # the runs keep the consumer waiting on purpose: its stall warning is expected
    pytest.mark.filterwarnings("ignore::zephon.DataStallWarning"),
]


def _slow_in_worker_1(x):
    import multiprocess

    if multiprocess.current_process().name == "zephon-worker-1":
        time.sleep(0.002)
    return x


def _pipe(**kw) -> zp.Pipeline:
    """2 workers, a 2-component mixture; a map that is slow in worker 1 only."""
    rng = np.random.default_rng(0)
    src = zp.StaticMixtureWorkSource(
        {
            "web": zp.ArraySource(["w" * int(n) for n in rng.integers(5, 120, 20_000)]),
            "code": zp.ArraySource(["c" * int(n) for n in rng.integers(5, 40, 20_000)]),
        },
        weights={"web": 0.7, "code": 0.3},
        seed=1,
        chunk_size=8,
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=2, **kw).fetch().map(_slow_in_worker_1)
    pipe = pipe.tokenize(zp.ByteTokenizer(add_eos=False)).split(max_len=64)
    return pipe.pack(seq_len=64).batch(4)


def _run_for(pipe: zp.Pipeline, seconds: float) -> int:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(pipe)
        n += 1
        time.sleep(0.003)  # the training step
    return n


def _png_size(path) -> tuple[int, int]:
    """The PNG's width and height, after checking its signature and header chunk."""
    with open(path, "rb") as f:
        head = f.read(33)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head[:8]
    length, kind = struct.unpack(">I4s", head[8:16])
    assert (length, kind) == (13, b"IHDR")
    assert zlib.crc32(head[12:29]) == struct.unpack(">I", head[29:33])[0]
    return struct.unpack(">II", head[16:24])


def test_record_then_report_draws_a_real_run(tmp_path, capsys):
    series, png = tmp_path / "loader.jsonl", tmp_path / "loader.png"
    with _pipe() as pipe:
        rec = zp.metrics.record(pipe, series, every_s=0.1)
        assert rec.samples == 0  # nothing before the first next()
        n = _run_for(pipe, 1.5)
        pipe.checkpoint()
        rec.close()
        written = rec.samples
        st = pipe.stats()
        assert not rec.running
    header, samples = zp.metrics.read_series(series)
    assert header["zephon_series"] == 1 and header["every_s"] == 0.1
    assert "Map(fn=_slow_in_worker_1" in header["pipeline"]
    assert len(samples) == written >= 8
    last = samples[-1]["scalars"]  # close() wrote one at the end: the run's totals
    assert last["zephon_batches_delivered_total"] == n == st["batches_delivered"]
    assert last["zephon_mixture_target_ratio/component=web"] == pytest.approx(0.7)
    times = [s["time_s"] for s in samples]
    assert times == sorted(times) and times[-1] - times[0] > 1.0
    # whole lines only: a torn last line (a crash mid-write) is left out
    with open(series, "ab") as f:
        f.write(b'{"time_s": 1, "scal')
    assert zp.metrics.read_series(series)[1] == samples

    assert main(["report", str(series), "--out", str(png)]) == 0
    assert f"{png}: {n:,} batches" in capsys.readouterr().out
    width, height = _png_size(png)
    assert (width, height) == (1300, 850)
    assert 40_000 < os.path.getsize(png) < 2_000_000


def test_the_recorder_stops_when_the_pipeline_closes_and_report_names_bad_input(tmp_path, capsys):
    series = tmp_path / "s.jsonl"
    series.write_bytes(b'{"zephon_series": 1, "every_s": 1.0}\n{"time_s": 1, "scal')  # a crash
    with _pipe() as pipe:
        rec = zp.metrics.record(pipe, series, every_s=0.05)
        _run_for(pipe, 0.4)
    deadline = time.monotonic() + 5
    while rec.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not rec.running  # the pipeline closed: the thread ended by itself
    rec.close()  # and closing again does nothing
    assert rec.samples >= 2
    # the resumed recording started on a line of its own, after the torn one: run 1
    header, samples = zp.metrics.read_series(series)
    assert header["every_s"] == 1.0 and len(samples) == rec.samples
    assert {s["run"] for s in samples} == {1}
    with pytest.raises(ValueError, match=r"every_s must be a number of seconds > 0; got 0"):
        zp.metrics.record(pipe, series, every_s=0)
    # report: not a series, too short a series, each a message and exit status 1
    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 1}\n')
    assert main(["report", str(other)]) == 1
    assert "not a zephon series" in capsys.readouterr().err
    short = tmp_path / "short.jsonl"
    short.write_text(series.read_text().splitlines()[2] + "\n")
    assert main(["report", str(short)]) == 1
    assert "0 sample(s); a report needs two or more" in capsys.readouterr().err


def _numbers_pipe() -> zp.Pipeline:
    """2 workers, two components of numbers, batches of 4."""
    src = zp.StaticMixtureWorkSource(
        {"a": zp.ArraySource(np.arange(1000)), "b": zp.ArraySource(np.arange(1000))},
        weights={"a": 0.5, "b": 0.5},
        seed=0,
        chunk_size=4,
    )
    return zp.Pipeline(src, canonical_replicas=2, workers=2).fetch().batch(4)


def test_closing_the_pipeline_writes_the_recorders_last_sample_and_closes_its_file(tmp_path):
    series = tmp_path / "s.jsonl"
    pipe = _numbers_pipe()
    rec = zp.metrics.record(pipe, series, every_s=3600)  # its timer never fires here
    for _ in range(7):
        next(pipe)
    st = pipe.stats()
    pipe.close()
    assert not rec.running and rec._fd is None  # the thread ended and the file is closed
    assert rec.samples == 1
    _, samples = zp.metrics.read_series(series)
    (last,) = [s["scalars"] for s in samples]  # written by close(): the figures at the end
    assert last["zephon_batches_delivered_total"] == 7 == st["batches_delivered"]
    assert last["zephon_tokens_delivered_total/component=a"] == st["mixture"]["a"]["tokens"]
    rec.close()  # closing it again does nothing
    pipe.close()
    assert rec.samples == 1 and len(zp.metrics.read_series(series)[1]) == 1


def test_a_pipeline_dropped_on_a_thread_inside_another_close_closes_without_a_hang(tmp_path):
    """A dropped pipeline's __del__ closes it, on whichever thread runs the GC pass, at any
    allocation: also inside another pipeline's close(), while that thread holds the lock
    of the running recorders (CI hung there). Its close() must not wait on that lock."""
    pipe: zp.Pipeline | None = _numbers_pipe()
    rec = zp.metrics.record(pipe, tmp_path / "s.jsonl", every_s=3600)
    next(pipe)
    engine = pipe._engine

    def drop_inside_a_close():
        nonlocal pipe
        with series_module._RUNNING_LOCK:  # as finish() holds it, in another close()
            pipe = None
            gc.collect()

    t = threading.Thread(target=drop_inside_a_close, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "__del__ -> close() waited on a lock its own thread holds"
    assert engine.closed and not rec.running and rec.samples == 1
    rec.close()


def test_a_pipeline_whose_last_reference_the_recorder_drops_still_closes(tmp_path, monkeypatch):
    """The user drops the pipeline while the recorder's thread reads its figures: that
    thread drops the last reference, and the __del__ it runs closes the pipeline (its
    workers too) without joining itself."""
    pipe: zp.Pipeline | None = _numbers_pipe()
    next(pipe)
    engine = pipe._engine
    reading, dropped = threading.Event(), threading.Event()
    real = series_module.scalars

    def scalars_once_dropped(p):
        reading.set()
        dropped.wait(10)
        return real(p)

    monkeypatch.setattr(series_module, "scalars", scalars_once_dropped)
    rec = zp.metrics.record(pipe, tmp_path / "s.jsonl", every_s=0.01)
    assert reading.wait(10)
    pipe = None  # the recorder's thread holds the last reference now
    dropped.set()
    rec._thread.join(10)
    assert not rec.running and engine.closed, "the pipeline dropped by its recorder stayed open"
    assert rec.error is None and rec.samples >= 1
    rec.close()


def test_zephon_top_under_a_pseudo_terminal_shows_the_rate_and_the_bottleneck():
    stop = threading.Event()
    with _pipe(metrics_port=0) as pipe:
        next(pipe)
        url = pipe._metrics.url
        consumer = threading.Thread(target=lambda: _consume(pipe, stop))
        consumer.start()
        try:
            screen, rc, once = _top_in_a_pty(url)
        finally:
            stop.set()
            consumer.join()
    assert rc == 0, screen
    assert "\x1b[?1049h" in screen and screen.endswith("\x1b[?25h\x1b[?1049l")  # restored
    last = screen.rsplit("\x1b[H", 1)[-1]
    m = re.search(r"batches\s+([\d.]+k?)/s\s+delivered ([\d,]+)", last)
    assert m is not None and float(m[1].rstrip("k")) > 0, last
    assert re.search(r"bottleneck\s+\x1b\[1mmap in worker 1\x1b\[0m \(\d+% busy\)", last), last
    assert re.search(r"worker 1\s+\d+%\s+\d+%\s+map \d+%", last), last
    assert re.search(r"web\s+70\.0%", last) and "ring fill   worker 0 [" in last
    # --once prints one plain screen
    assert once.returncode == 0, once.stderr
    assert "\x1b" not in once.stdout and "bottleneck  map in worker 1" in once.stdout


def _consume(pipe: zp.Pipeline, stop: threading.Event) -> None:
    while not stop.is_set():
        next(pipe)
        time.sleep(0.003)


def _top_in_a_pty(url: str) -> tuple[str, int, subprocess.CompletedProcess]:
    """Run ``zephon top URL`` on a pseudo-terminal until it has drawn three screens, press
    q; the text it wrote and its exit status. Then ``zephon top --once``."""
    cmd = [sys.executable, "-m", "zephon.cli", "top"]
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen(
        [*cmd, url, "--interval", "0.3"], stdin=sub_fd, stdout=sub_fd, stderr=sub_fd
    )
    os.close(sub_fd)
    got = b""
    try:
        deadline = time.monotonic() + 20
        while got.count(b"\x1b[H") < 3 and time.monotonic() < deadline:
            if select.select([main_fd], [], [], 0.5)[0]:
                got += os.read(main_fd, 65536)
        os.write(main_fd, b"q")
        rc = proc.wait(timeout=10)
        while select.select([main_fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            got += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)
    once = subprocess.run(
        [*cmd, url, "--once", "--interval", "0.3"], capture_output=True, text=True, timeout=30
    )
    return got.decode(errors="replace"), rc, once


def test_top_names_an_endpoint_it_cannot_read(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        assert main(["top", str(port), "--once", "--interval", "0.01"]) == 1
    err = capsys.readouterr().err
    assert f"cannot read http://127.0.0.1:{port}/metrics" in err and "metrics_port" in err


def test_the_text_format_and_scalars_give_the_same_frame():
    text = (
        "# TYPE zephon_stage_busy_seconds_total counter\n"
        'zephon_stage_busy_seconds_total{rank="0",stage="map",worker="1"} 2.0\n'
        'zephon_stage_busy_seconds_total_created{rank="0",stage="map",worker="1"} 1.7e9\n'
        'zephon_mixture_target_ratio{component="a/\\"b\\"",rank="0"} 0.25\n'
        'zephon_next_wait_seconds_bucket{le="0.01",rank="0"} 3.0\n'
        'zephon_next_wait_seconds_bucket{le="+Inf",rank="0"} 4.0\n'
    )
    flat = parse_text(text)
    assert flat == {
        "zephon_stage_busy_seconds_total/stage=map/worker=1": 2.0,
        'zephon_mixture_target_ratio/component=a/"b"': 0.25,
        "zephon_next_wait_seconds_bucket/le=0.01": 3.0,
        "zephon_next_wait_seconds_bucket/le=+Inf": 4.0,
    }
    scalars = {"zephon_stage_busy_seconds_total/worker=1/stage=map": 2.0}
    assert canonical(scalars) == {"zephon_stage_busy_seconds_total/stage=map/worker=1": 2.0}
    before = {"zephon_stage_busy_seconds_total/worker=1/stage=map": 1.5}
    f = frame(scalars, before, dt=1.0)
    assert f["places"]["1"]["stages"]["map"] == {"seconds": 2.0, "ratio": 0.5}
    assert frame(flat)["wait_p50_s"] == 0.01 and frame(flat)["wait_p90_s"] == float("inf")
    assert frame(flat)["mixture"] == {'a/"b"': {"target": 0.25, "drift": None}}


def test_a_frame_and_top_show_each_sources_read_rate():
    from zephon.cli.top import render

    before = {
        "zephon_source_read_bytes_total/source=web": 1024.0,
        "zephon_source_read_requests_total/source=web": 2.0,
        "zephon_source_read_retries_total/source=web": 0.0,
        "zephon_source_read_requests_total/source=mem": 0.0,
    }
    now = {
        "zephon_source_read_bytes_total/source=web": 5 * 1024.0,
        "zephon_source_read_requests_total/source=web": 6.0,
        "zephon_source_read_retries_total/source=web": 1.0,
        "zephon_source_read_requests_total/source=mem": 0.0,
        "zephon_batches_delivered_total": 10.0,
    }
    f = frame(now, before, dt=2.0)
    assert f["reads"]["web"] == {
        "bytes": 5120.0,
        "bytes_rate": 2048.0,
        "requests": 6.0,
        "requests_rate": 2.0,
        "retries": 1.0,
        "retries_rate": 0.5,
    }
    (line,) = [x for x in render("u", now, before, 2.0, 2.0, bold=False) if x.startswith("reads")]
    assert line == "reads       web 2.0 KiB/s 2/s (1 retried)"  # mem made no range reads
