"""``zephon top URL``: a running pipeline's figures, live in the terminal, from its metrics
endpoint (``Pipeline(metrics_port=)``): rates, the consumer's wait, the bottleneck, busy
time per place and stage, ring fill, the mixture's drift. Plain ANSI redraws, no curses;
``q`` or Ctrl-C quits; ``--once`` prints one screen (rates over ``--interval``) and exits."""

from __future__ import annotations

import argparse
import os
import select
import shutil
import sys
import time
import urllib.request
from typing import Any

from zephon.metrics.view import Flat, frame, parse_text

BOLD, RESET = "\x1b[1m", "\x1b[0m"
#: The alternate screen and the cursor, entered and hidden while live; restored at exit.
_ENTER, _LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


def endpoint(url: str) -> str:
    """``9100`` -> ``http://127.0.0.1:9100/metrics``; ``host:port`` and ``http://host:port``
    get the scheme and the path they lack."""
    if url.isdigit():
        url = f"127.0.0.1:{url}"
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url += "/metrics"
    return url


def scrape(url: str, timeout_s: float = 5.0) -> Flat:
    """The endpoint's ``zephon_*`` figures now.

    Raises:
        OSError: the endpoint cannot be read (named, with what to check).
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError) as e:
        raise OSError(
            f"cannot read {url}: {getattr(e, 'reason', e)} (is the pipeline running with "
            "Pipeline(metrics_port=PORT) or zp.metrics.serve(pipe, PORT), and past its first "
            "next()?)"
        ) from e
    return parse_text(text)


def _pct(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.1f}{suffix}{unit}"
    return f"{v:.1f}{unit}" if v != int(v) else f"{int(v)}{unit}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{int(v)} B"


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    if v == float("inf"):
        return "> 10 s"
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.1f} s"


def _bar(filled: float, total: float, width: int = 12) -> str:
    n = 0 if total <= 0 else round(width * min(1.0, filled / total))
    return "[" + "#" * n + "." * (width - n) + "]"


def render(
    url: str, now: Flat, prev: Flat | None, dt: float | None, interval_s: float, bold: bool
) -> list[str]:
    """One screen, as lines (no colour but bold where ``bold``)."""
    b0, b1 = (BOLD, RESET) if bold else ("", "")
    f = frame(now, prev, dt)
    clock = time.strftime("%H:%M:%S")
    lines = [f"{b0}zephon top{b1}  {url}  {clock}  every {interval_s:g} s  (q quits)", ""]
    if f["batches"] is None:
        return [*lines, "no batches yet: the pipeline has not run its first next()"]
    lines.append(
        f"batches     {_num(f['batch_rate'], '/s'):>10}   delivered {int(f['batches']):,}"
        f"   step {int(f['step'] or 0):,}"
    )
    if f["token_rate"] is not None or f["mixture"]:
        lines.append(f"tokens      {_num(f['token_rate'], '/s'):>10}")
    lines.append(
        f"next() wait {_pct(f['wait_ratio'], 1):>10}   of the time (since the first batch "
        f"{_pct(f['wait_ratio_total'], 1)}); p50 <= {_seconds(f['wait_p50_s'])}, "
        f"p90 <= {_seconds(f['wait_p90_s'])}"
    )
    b = f["bottleneck"]
    if b is not None:
        busy = "" if b["busy_ratio"] is None else f" ({_pct(b['busy_ratio'])} busy)"
        lines.append(f"bottleneck  {b0}{b['stage']} in {b['where']}{b1}{busy}")
    lines.append("")
    places = f["places"]
    if places:
        lines.append(f"{'place':<10} {'busy':>6} {'now':>6}   stages now (share of wall time)")
        for where in sorted(places, key=lambda w: (w == "parent", w.zfill(6))):
            p = places[where]
            stages = sorted(
                ((s["ratio"] or 0.0, name) for name, s in p["stages"].items()), reverse=True
            )
            shown = "  ".join(f"{name} {_pct(r)}" for r, name in stages if r >= 0.005)
            name = where if where == "parent" else f"worker {where}"
            up = "" if f["workers_up"].get(where, 1) else "  (exited)"
            lines.append(
                f"{name:<10} {_pct(p['ratio']):>6} {_pct(p['ratio_now']):>6}   {shown or '-'}{up}"
            )
        lines.append("")
    if f["rings"]:
        rings = "   ".join(
            f"worker {w} {_bar(filled, slots or 0)} {int(filled)}/{int(slots or 0)}"
            for w, (filled, slots) in sorted(f["rings"].items())
        )
        lines.append(f"ring fill   {rings}")
    q, cap = f["prefetch"]
    inflight = ", ".join(
        f"{'' if w == 'parent' else 'worker '}{w} {int(n)}"
        for w, n in sorted(f["inflight_chunks"].items())
    )
    queue = "off" if not cap else f"{'-' if q is None else int(q)}/{int(cap)} batches"
    lines.append(f"prefetch    {queue}   chunks in flight: {inflight or '-'}")
    reads = [(s, r) for s, r in f["reads"].items() if r.get("requests")]
    if reads:  # sources that made range reads (files; not in-memory arrays)
        lines.append(
            "reads       "
            + "   ".join(
                f"{s[:12]} {_bytes(r.get('bytes_rate'))}/s {_num(r.get('requests_rate'), '/s')}"
                + (f" ({int(r['retries'])} retried)" if r.get("retries") else "")
                for s, r in reads[:6]
            )
        )
    if f["mixture"]:
        lines += ["", f"{'mixture':<12} {'target':>7} {'docs':>7} {'tokens':>7} {'drift':>9}"]
        for comp, m in f["mixture"].items():
            target, docs = m.get("target"), m.get("document_share")
            drift = "-"
            if m.get("drift") is not None:  # + 0.0: no "-0.0"
                drift = f"{round(100 * m['drift'], 1) + 0.0:+.1f} pt"
            lines.append(
                f"{comp[:12]:<12} {_pct(target, 1):>7} {_pct(docs, 1):>7} "
                f"{_pct(m.get('token_share'), 1):>7} {drift:>9}"
            )
    if f["checkpoints"]:
        lines += [
            "",
            f"checkpoints {int(f['checkpoints'])}, the last {_seconds(f['checkpoint_last_s'])}, "
            f"{_bytes(f['checkpoint_bytes'])}",
        ]
    return lines


def _once(url: str, interval_s: float) -> int:
    try:
        prev = scrape(url)
        t0 = time.monotonic()
        time.sleep(interval_s)
        now = scrape(url)
    except OSError as e:
        print(f"zephon top: {e}", file=sys.stderr)
        return 1
    print("\n".join(render(url, now, prev, time.monotonic() - t0, interval_s, bold=False)))
    return 0


def _live(url: str, interval_s: float) -> int:
    out = sys.stdout
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    saved: Any = None
    if fd is not None:
        import termios
        import tty

        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)  # keys arrive one at a time, unechoed; Ctrl-C still interrupts
    out.write(_ENTER)
    prev: Flat | None = None
    prev_t = 0.0
    try:
        while True:
            t = time.monotonic()
            try:
                now = scrape(url, timeout_s=max(1.0, interval_s))
                lines = render(url, now, prev, t - prev_t if prev else None, interval_s, True)
                prev, prev_t = now, t
            except OSError as e:
                lines = [f"{BOLD}zephon top{RESET}  {url}", "", str(e), "", "retrying; q quits"]
                prev = None
            width, height = shutil.get_terminal_size()
            screen = "".join(f"{line[: width + 8]}\x1b[K\r\n" for line in lines[: height - 1])
            out.write("\x1b[H" + screen + "\x1b[J")
            out.flush()
            if _quit_within(fd, interval_s - (time.monotonic() - t)):
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(_LEAVE)
        out.flush()
        if saved is not None and fd is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_within(fd: int | None, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``q`` on the terminal; True if it came."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if fd is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            key = os.read(fd, 32)
            if not key or b"q" in key.lower():
                return True


def top(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        print(f"zephon top: --interval must be > 0 seconds; got {args.interval}", file=sys.stderr)
        return 2
    url = endpoint(args.url)
    if args.once or not sys.stdout.isatty():
        return _once(url, args.interval)
    return _live(url, args.interval)
