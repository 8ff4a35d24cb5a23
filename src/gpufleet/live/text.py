"""The live view as one line of text: the terminal's status line, and the formats both views share."""

from __future__ import annotations

from .snapshot import DONE, FAILED, RUNNING, STARTING, Snapshot


def fmt_seconds(s: float | None) -> str:
    """``7 s``, ``2 m 05 s``, ``1 h 02 m``."""
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} m {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} m"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return ""
    return f"{rate:.1f}" if rate < 100 else f"{rate:.0f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def status_parts(snap: Snapshot) -> list[str]:
    """The status line's parts: ranks by state, step (of total), steps/s, metrics, GPUs, ETA, elapsed, run id."""
    return [*progress_parts(snap), fmt_seconds(snap.elapsed_s), f"run {snap.run_id}"]


def progress_parts(snap: Snapshot) -> list[str]:
    """Ranks by state, step (of total), steps/s, rank 0's last metrics, GPU utilisation, ETA."""
    counts = snap.counts()
    n = len(snap.ranks)
    states = [f"{counts[s]} {s}" for s in (STARTING, RUNNING, DONE, FAILED, "stopped") if counts.get(s)]
    parts = [f"{n} ranks: " + ", ".join(states) if states else f"{n} ranks"]
    if snap.attempt > 1:
        parts.append(f"attempt {snap.attempt}")
    if any(r.state != STARTING for r in snap.ranks):
        parts.append(f"step {snap.step}/{snap.total}" if snap.total else f"step {snap.step}")
        if snap.rate is not None and counts.get(RUNNING):
            parts.append(f"{fmt_rate(snap.rate)} steps/s")
    for name, value in sorted(snap.last_metrics().items())[:3]:
        parts.append(f"{name} {value:.4g}")
    for g in snap.gpus[:8]:
        util = f"{g.util_percent:.0f}%" if g.util_percent is not None else "?"
        parts.append(f"GPU{g.index} {util}")
    if snap.eta_s is not None:
        parts.append(f"ETA {fmt_seconds(snap.eta_s)}")
    return parts


def status_line(snap: Snapshot) -> str:
    """One plain line (``2 ranks: 2 running | step 40/100 | 9.5 steps/s | loss 0.31 | ... | run X``)."""
    return " | ".join(status_parts(snap))


def summary_line(snap: Snapshot) -> str:
    """The line printed when the run ended: outcome, time, ranks, final metrics, MLflow run."""
    parts = [f"run {snap.run_id} {snap.state} in {fmt_seconds(snap.elapsed_s)}", f"{len(snap.ranks)} ranks",
             f"step {snap.step}"]  # fmt: skip
    failed = [str(r.rank) for r in snap.ranks if r.state == FAILED]
    if failed:
        parts.append("failed: rank " + ", ".join(failed))
    parts += [f"{k} {v:.4g}" for k, v in sorted(snap.last_metrics().items())[:4]]
    if snap.mlflow_run_id:
        parts.append(f"MLflow run {snap.mlflow_run_id}")
    return " | ".join(parts)


_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def rich_line(snap: Snapshot) -> object:
    """The status line for rich's ``Live``: a spinner, the parts, failed ranks in red; cut at the terminal's width."""
    from rich.text import Text

    text = Text(no_wrap=True, overflow="ellipsis")
    if snap.state == "RUNNING":
        text.append(_FRAMES[int(snap.elapsed_s * 8) % len(_FRAMES)] + " ", style="green")
    for i, part in enumerate(status_parts(snap)):
        if i:
            text.append(" · ", style="dim")
        style = "bold" if part.startswith("run ") else "red" if FAILED in part else "cyan" if part.startswith("step") else ""
        text.append(part, style=style)
    return text
