"""The progression's output: a rich table, a two-sentence summary, JSON rows."""

from __future__ import annotations

from dataclasses import asdict

from .steps import StepResult


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "-"


def _x(v: float) -> str:
    return f"{v:.2f}x" if v else "-"


def _tps(v: float) -> str:
    return f"{v:,.0f}" if v else "-"


def _budget_batch(r: StepResult) -> str:
    if not r.budget_batch:
        return "-"
    cap = ", cap" if r.budget_capped and r.budget_batch > r.batch else ""
    return f"{r.budget_batch} ({r.budget_batch / r.batch:g}x{cap})"


def table(results: list[StepResult], title: str = "Progressive optimization"):
    """A rich Table: speed and memory at the demo batch, then the largest batch that fits the
    baseline's activation budget (its measured bytes) and the speed there."""
    from rich.table import Table

    t = Table(title=title)
    budget = any(r.budget_batch for r in results)
    cols = [("step", "left"), ("tokens/s", "right"), ("vs base", "right"),
            ("saved act.", "right"), ("vs base", "right")]
    if budget:
        cols += [("batch @ budget", "right"), ("saved @ budget", "right"),
                 ("tokens/s @ budget", "right"), ("vs base", "right")]
    for col, just in cols + [("verified", "center")]:
        t.add_column(col, justify=just)
    for r in results:
        ok = "[green]yes[/green]" if r.verified else ("[red]NO[/red]" if r.tokens_per_s
                                                      else "skipped")
        row = [r.name, _tps(r.tokens_per_s), _x(r.speedup), _mib(r.saved_bytes),
               _x(r.memory_ratio)]
        if budget:
            row += [_budget_batch(r), _mib(r.budget_saved_bytes), _tps(r.budget_tokens_per_s),
                    _x(r.budget_speedup)]
        t.add_row(*row, ok)
    return t


def summary(results: list[StepResult]) -> list[str]:
    """The trade in two sentences: the fastest step at the demo batch, and the fastest within
    the baseline's activation memory (with the batch that bought it). Ratios are this run's."""
    ran = [r for r in results[1:] if r.tokens_per_s]
    if not ran:
        return []
    fast = max(ran, key=lambda r: r.speedup)
    lines = [f"At the demo batch ({fast.batch}): fastest step '{fast.name}', {fast.speedup:.2f}x "
             f"the baseline's tokens/s, {fast.memory_ratio:.2f}x its saved activations."]
    fits = [r for r in ran if r.budget_speedup]
    if fits:
        best = max(fits, key=lambda r: r.budget_speedup)
        lines.append(f"Within the baseline's activation memory: '{best.name}' trains batch "
                     f"{best.budget_batch} ({best.budget_batch / best.batch:g}x) at "
                     f"{best.budget_speedup:.2f}x the baseline's tokens/s.")
    return lines


def to_json(results: list[StepResult]) -> list[dict]:
    return [asdict(r) for r in results]
