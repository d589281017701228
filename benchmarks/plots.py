"""PNG plots for the benchmark suite (matplotlib, Agg backend; optional).

Every function returns the path it wrote, or ``None`` (with a note on stderr) when matplotlib
is not installed: a plot is a convenience, never a reason for a benchmark to fail.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def _save(fig: Any, plt: Any, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, out)
    return out


def tradeoff_plot(
    path: str | os.PathLike[str],
    x: Sequence[float],
    panels: Sequence[Mapping[str, Any]],
    *,
    xlabel: str,
    title: str,
    log2_x: bool = True,
) -> Path | None:
    """One small panel per metric against a common ``x`` (e.g. ``flush_every_k_chunks``).

    Each panel: ``{"y": values, "ylabel": str, "better": "lower"|"higher"}`` and optionally
    ``"range": (mins, maxs)`` drawn as error bars, ``"ref": (values, label)`` as a dashed line,
    ``"from_zero": True`` to start the y axis at 0.
    """
    plt = _pyplot()
    if plt is None:
        return None
    n = len(panels)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        y = list(panel["y"])
        rng = panel.get("range")
        if rng is not None:
            lo, hi = rng
            err = [
                [yi - a for yi, a in zip(y, lo, strict=True)],
                [b - yi for yi, b in zip(y, hi, strict=True)],
            ]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3)
        else:
            ax.plot(x, y, marker="o")
        ref = panel.get("ref")
        if ref is not None:
            ax.plot(x, list(ref[0]), linestyle="--", color="grey", label=ref[1])
            ax.legend(fontsize=8)
        if panel.get("from_zero"):
            ax.set_ylim(bottom=0)
        better = panel.get("better")
        ax.set_title(panel["ylabel"] + (f"\n({better} is better)" if better else ""), fontsize=9)
        ax.set_xlabel(xlabel)
        if log2_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(x))
            ax.set_xticklabels([str(v) for v in x])
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def share_plot(
    path: str | os.PathLike[str],
    series: Mapping[str, Sequence[Sequence[float]]],
    targets: Sequence[float],
    component_names: Sequence[str],
    *,
    window: int,
    title: str,
) -> Path | None:
    """Per-component share over sliding windows: one panel per component, one line per
    approach (``series[name][w][c]``: share of component c in window w), the target dashed."""
    plt = _pyplot()
    if plt is None:
        return None
    n = len(component_names)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.6), squeeze=False)
    for c, ax in enumerate(axes.flat):
        for name, shares in series.items():
            ax.plot(range(len(shares)), [s[c] for s in shares], label=name, linewidth=1.2)
        ax.axhline(targets[c], color="black", linestyle="--", linewidth=1, label="target")
        ax.set_title(f"{component_names[c]}: token share")
        ax.set_xlabel(f"window start (batch), windows of {window} batches")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    axes.flat[0].set_ylabel("token share")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return _save(fig, plt, path)


def share_error_plot(
    path: str | os.PathLike[str],
    series: Mapping[str, Sequence[Sequence[float]]],
    targets: Sequence[float],
    component_names: Sequence[str],
    *,
    window: int,
    band_pp: float,
    title: str,
) -> Path | None:
    """Per-component error of the share over sliding windows, in percentage points: one
    panel per component, one line per approach (``series[name][w][c]``: share of component c
    in window w), a shaded band of ``±band_pp``."""
    plt = _pyplot()
    if plt is None:
        return None
    n = len(component_names)
    fig, axes = plt.subplots(1, n, figsize=(4.8 * n, 3.8), squeeze=False, sharey=True)
    for c, ax in enumerate(axes.flat):
        ax.axhspan(-band_pp, band_pp, color="0.9", label=f"±{band_pp:g} pp")
        for name, shares in series.items():
            ax.plot(
                range(len(shares)),
                [100 * (s[c] - targets[c]) for s in shares],
                label=name,
                linewidth=1.0,
            )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"{component_names[c]} (target {targets[c]:g})")
        ax.set_xlabel(f"window start (batch), windows of {window} batches")
        ax.grid(True, alpha=0.3)
    axes.flat[0].set_ylabel("token share - target (pp)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return _save(fig, plt, path)
