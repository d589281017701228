"""``zephon report SERIES --out PNG``: a series that ``zp.metrics.record`` wrote, drawn as
one picture: throughput and the consumer's wait over time, busy time per stage, each
mixture component's share against its target. matplotlib is imported here only."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any

from zephon.metrics.series import read_series
from zephon.metrics.view import frame

#: One colour per stage or component, in order (matplotlib's tab10, without its grey).
_COLOURS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
]


#: At most this many places get a line of their own in the busy panel.
_PLACE_LINES = 4


def frames(
    samples: list[dict[str, Any]], min_dt_s: float = 0.0
) -> tuple[list[float], list[dict[str, Any]]]:
    """Per interval of one run: the time at its end (seconds since the first sample) and
    the :func:`~zephon.metrics.view.frame` over it. An interval is at least ``min_dt_s``
    long (a sample closer to the last one, such as the one ``Recorder.close()`` writes
    just after another, waits for the next: rates over a few milliseconds are noise)."""
    if not samples:
        return [], []
    t0 = samples[0]["time_s"]
    times, out = [], []
    prev = samples[0]
    for now in samples[1:]:
        if prev["run"] != now["run"]:
            prev = now
            continue
        dt = now["time_s"] - prev["time_s"]
        if dt <= 0 or dt < min_dt_s:
            continue
        times.append(now["time_s"] - t0)
        out.append(frame(now["scalars"], prev["scalars"], dt))
        prev = now
    return times, out


def draw(series: str, out: str) -> str:
    """Draw ``series`` into the PNG ``out``; returns a one-line summary.

    Raises:
        ValueError: the series is not one, or has fewer than two samples.
        ImportError: matplotlib is not installed.
    """
    header, samples = read_series(series)
    every_s = header.get("every_s")
    times, fr = frames(samples, 0.5 * every_s if isinstance(every_s, int | float) else 0.0)
    if not fr:
        raise ValueError(
            f"{series}: {len(samples)} sample(s); a report needs two or more of one run (record "
            "for longer than every_s, or with a smaller every_s)"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    except ImportError as e:
        raise ImportError(
            "zephon report draws with matplotlib: pip install matplotlib (or 'zephon[jax]')"
        ) from e

    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_rate, ax_wait), (ax_busy, ax_mix) = fig.subplots(2, 2, sharex=True)
    last = fr[-1]
    cumulative = frame(samples[-1]["scalars"])

    # throughput
    def series_of(key: str) -> list[float]:
        return [float("nan") if f[key] is None else f[key] for f in fr]

    ax_rate.plot(times, series_of("batch_rate"), color=_COLOURS[0], lw=1.6, label="batches/s")
    ax_rate.set_ylabel("batches / s", color=_COLOURS[0])
    ax_rate.set_ylim(bottom=0)
    ax_rate.spines["top"].set_visible(False)
    ax_rate.set_title("Throughput", loc="left", fontweight="bold")
    if any(f["token_rate"] is not None for f in fr):
        ax_tok = ax_rate.twinx()
        ax_tok.plot(times, series_of("token_rate"), color=_COLOURS[1], lw=1.2, alpha=0.8)
        ax_tok.set_ylabel("tokens / s", color=_COLOURS[1])
        ax_tok.set_ylim(bottom=0)
        ax_tok.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax_tok.spines["top"].set_visible(False)
    # the consumer's wait
    wait = [float("nan") if f["wait_ratio"] is None else 100 * f["wait_ratio"] for f in fr]
    ax_wait.plot(times, wait, color=_COLOURS[3], lw=1.6, label="in each interval")
    total = [
        float("nan") if f["wait_ratio_total"] is None else 100 * f["wait_ratio_total"] for f in fr
    ]
    ax_wait.plot(times, total, color="0.35", lw=1.2, ls="--", label="since the first batch")
    ax_wait.axhline(10, color="0.6", lw=0.8, ls=":")
    ax_wait.annotate(
        "stall warning (10%)",
        (0, 10),
        xycoords=("axes fraction", "data"),
        xytext=(4, 3),
        textcoords="offset points",
        fontsize=8,
        color="0.45",
    )
    ax_wait.set_ylim(0, max(15.0, min(100.0, 1.15 * _finite_max(wait + total))))
    ax_wait.set_ylabel("% of the consumer's time in next()")
    ax_wait.set_title("The consumer's wait", loc="left", fontweight="bold")
    ax_wait.legend(loc="upper right", fontsize=8, frameon=False)
    # busy time per stage, summed over places
    stages = list(last["stages"])
    ys = [
        [float("nan") if f["stages"].get(s) is None else f["stages"][s] for f in fr] for s in stages
    ]
    if stages:
        filled = [[0.0 if y != y else y for y in row] for row in ys]
        ax_busy.stackplot(
            times,
            filled,
            labels=stages,
            colors=[_COLOURS[i % len(_COLOURS)] for i in range(len(stages))],
            alpha=0.85,
        )
        top = max((sum(col) for col in zip(*filled, strict=True)), default=1.0)
        # each place's own busy fraction (at most _PLACE_LINES of them): an uneven split
        # shows here, where the stacked sum hides it
        where = sorted(last["places"], key=lambda w: (w == "parent", w.zfill(6)))
        for k, w in enumerate(where[:_PLACE_LINES]):
            row = [f["places"].get(w, {}).get("ratio_now") for f in fr]
            ax_busy.plot(
                times,
                [float("nan") if r is None else r for r in row],
                color="0.15",
                lw=1.0,
                ls=("-", "--", "-.", ":")[k % 4],
                label=w if w == "parent" else f"worker {w} (all stages)",
            )
            top = max(top, _finite_max([float("nan") if r is None else r for r in row]))
        ax_busy.legend(loc="upper left", fontsize=8, frameon=False, ncol=4)
        ax_busy.set_ylim(0, max(1.0, 1.3 * top))
    ax_busy.set_ylabel("busy processes (1 = one fully busy)")
    ax_busy.set_xlabel("seconds since the first sample")
    title = "Busy time per stage"
    b = cumulative["bottleneck"]
    if b is not None:
        title += f" — bottleneck: {b['stage']} in {b['where']}"
    ax_busy.set_title(title, loc="left", fontweight="bold")
    # the mixture
    comps = list(last["mixture"])
    if comps:
        for i, c in enumerate(comps):
            colour = _COLOURS[i % len(_COLOURS)]
            docs = [_pct(f["mixture"].get(c, {}).get("document_share")) for f in fr]
            tokens = [_pct(f["mixture"].get(c, {}).get("token_share")) for f in fr]
            target = [_pct(f["mixture"].get(c, {}).get("target")) for f in fr]
            ax_mix.plot(times, docs, color=colour, lw=1.8, label=f"{c}: documents")
            ax_mix.plot(times, tokens, color=colour, lw=1.0, ls=":", label=f"{c}: tokens")
            ax_mix.plot(times, target, color=colour, lw=1.2, ls="--", label=f"{c}: target")
        ax_mix.set_ylim(0, 100)
        ax_mix.legend(loc="best", fontsize=8, frameon=False, ncol=len(comps))
        ax_mix.set_ylabel("% of documents, of tokens delivered")
        ax_mix.set_title("Mixture: realized share against target", loc="left", fontweight="bold")
    else:
        ax_mix.text(0.5, 0.5, "no mixture components", ha="center", va="center", color="0.5")
        ax_mix.set_axis_off()
    ax_mix.set_xlabel("seconds since the first sample")
    # before the first batch (worker processes starting, the first chunks read)
    first = next((i for i, f in enumerate(fr) if f["batches"]), 0)
    for ax in (ax_rate, ax_wait, ax_busy, ax_mix):
        if first > 0:  # the end of the last interval with no batch
            ax.axvspan(0, times[first - 1], color="0.94", lw=0)
    if first > 0 and times[first - 1] > 0.15 * times[-1]:  # where the words fit
        ax_rate.text(
            times[first - 1] / 2,
            0.5,
            "before the\nfirst batch",
            transform=ax_rate.get_xaxis_transform(),
            ha="center",
            va="center",
            fontsize=8,
            color="0.5",
        )
        ax.grid(True, color="0.9", lw=0.6)
        ax.set_xlim(0, times[-1])
        if ax is not ax_rate:
            ax.spines[["top", "right"]].set_visible(False)
    duration = samples[-1]["time_s"] - samples[0]["time_s"]
    batches = cumulative["batches"] or 0
    summary = (
        f"{int(batches):,} batches in {duration:.{0 if duration >= 10 else 1}f} s of samples"
        f" ({len(samples)} samples, every {header.get('every_s', '?')} s)"
    )
    pipeline = textwrap.shorten(str(header.get("pipeline", "")), 150, placeholder=" …")
    fig.suptitle(f"zephon report — {os.path.basename(series)}: {summary}\n{pipeline}", fontsize=10)
    fig.savefig(out, dpi=100)
    return f"{out}: {summary}"


def _pct(v: float | None) -> float:
    return float("nan") if v is None else 100 * v


def _finite_max(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return max(finite, default=0.0)


def report(args: argparse.Namespace) -> int:
    out = args.out or os.path.splitext(args.series)[0] + ".png"
    try:
        line = draw(args.series, out)
    except (OSError, ValueError, ImportError) as e:
        print(f"zephon report: {e}", file=sys.stderr)
        return 1
    print(line)
    return 0
