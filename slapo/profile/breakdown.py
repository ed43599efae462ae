"""TBD-style memory breakdown of one training step: weights, gradients, optimizer state, activations.

Why: schedules trade memory for compute, so each one needs a meter whose categories match the
decisions (TBD, Zhu et al. 2018): activations are what checkpointing and Tempo shrink, optimizer
state is what ZeRO shards, weights and gradients are what tensor parallelism splits. The numbers are
exact byte counts of tensors (de-duplicated by storage), not allocator estimates, so they are the
same on CPU and GPU and a test can assert them.

"Activations" are the bytes autograd holds for backward at the end of the forward pass (via
`saved_tensors_hooks`), attributed to the innermost module whose forward was running when the
tensor was saved. On CUDA the allocator peak is reported as well.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .live import LiveTensorBytes
from .saved import SavedTensorRecorder, storage_key, storage_keys

CATEGORIES = ("weights", "grads", "optimizer_state", "activations")


@dataclass
class MemoryBreakdown:
    """Result of `memory_breakdown`. All sizes are bytes.

    `per_module[path]` holds the bytes owned *directly* by that module (its own parameters, their
    gradients, and the activations saved while it was the innermost running module); use
    `aggregate(depth)` to roll them up. The root module's path is "".
    """

    weights: int
    grads: int
    optimizer_state: int
    activations: int
    per_module: dict[str, dict[str, int]] = field(default_factory=dict)
    live_after_forward: int | None = None
    peak_live: int | None = None
    cuda_peak_allocated: int | None = None
    device: str = "cpu"

    @property
    def total(self) -> int:
        """Weights + gradients + optimizer state + saved activations."""
        return self.weights + self.grads + self.optimizer_state + self.activations

    def module_bytes(self, prefix: str, category: str = "activations") -> int:
        """Bytes of `category` owned by module `prefix` and all its descendants."""
        return sum(
            v.get(category, 0)
            for p, v in self.per_module.items()
            if p == prefix or prefix == "" or p.startswith(prefix + ".")
        )

    def aggregate(self, depth: int | None = None) -> dict[str, dict[str, int]]:
        """Per-module bytes rolled up to paths with at most `depth` components (None: no roll-up)."""
        out: dict[str, dict[str, int]] = {}
        for path, cats in self.per_module.items():
            key = path
            if depth is not None and path:
                key = ".".join(path.split(".")[:depth]) if depth > 0 else ""
            row = out.setdefault(key, dict.fromkeys(("weights", "grads", "activations"), 0))
            for c, v in cats.items():
                row[c] = row.get(c, 0) + v
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """JSON text of the breakdown; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=True)
        if path is not None:
            Path(path).write_text(text)
        return text

    def table(self, depth: int | None = 2, title: str = "Memory breakdown") -> Any:
        """A `rich.table.Table` with totals and per-module rows (print it with rich's console)."""
        from rich.table import Table

        t = Table(title=f"{title} ({self.device})")
        t.add_column("module / category")
        for c in ("weights", "grads", "activations"):
            t.add_column(c, justify="right")
        for path, row in self.aggregate(depth).items():
            if any(row.values()):
                t.add_row(
                    path or "<root>",
                    *(_mib(row.get(c, 0)) for c in ("weights", "grads", "activations")),
                )
        t.add_section()
        t.add_row("total", _mib(self.weights), _mib(self.grads), _mib(self.activations))
        t.add_row("optimizer state", "", "", _mib(self.optimizer_state))
        t.add_row("weights+grads+opt+act", "", "", _mib(self.total))
        if self.live_after_forward is not None:
            t.add_row("live after forward", "", "", _mib(self.live_after_forward))
        if self.peak_live is not None:
            t.add_row("peak live (fwd+bwd)", "", "", _mib(self.peak_live))
        if self.cuda_peak_allocated is not None:
            t.add_row("CUDA max allocated", "", "", _mib(self.cuda_peak_allocated))
        return t

    def plot(self, path: str | Path, depth: int | None = 2) -> Path:
        """Write a PNG stacked bar chart (MiB per module and category) to `path`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = {p: r for p, r in self.aggregate(depth).items() if any(r.values())}
        names = [p or "<root>" for p in rows]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(names) + 2), 4.5))
        bottom = [0.0] * len(names)
        for c in ("weights", "grads", "activations"):
            vals = [r.get(c, 0) / 2**20 for r in rows.values()]
            ax.bar(names, vals, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("MiB")
        ax.set_title(
            f"Memory per module ({self.device}); optimizer state {_mib(self.optimizer_state)} MiB"
        )
        ax.tick_params(axis="x", rotation=60)
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png")
        plt.close(fig)
        return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, Sequence) and not isinstance(inputs, torch.Tensor):
        return model(*inputs)
    return model(inputs)


def default_loss(output: Any) -> torch.Tensor:
    """`output.loss` if the model returned one (HF), else the sum of the first tensor output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    values = output.values() if isinstance(output, Mapping) else output
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float().sum()
    raise ValueError(
        "memory_breakdown: the model output has no `.loss` and no floating tensor; pass loss_fn="
    )


def _bytes_of(tensors: list[torch.Tensor], skip: set[tuple[str, int]]) -> tuple[int, set]:
    keys = set()
    total = 0
    for t in tensors:
        k = storage_key(t)
        if k is None or k in skip or k in keys:
            continue
        keys.add(k)
        total += t.untyped_storage().nbytes()
    return total, keys


def memory_breakdown(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    track_live: bool = True,
    exclude: Sequence[Any] = (),
) -> MemoryBreakdown:
    """Run one training step (forward, backward, `optimizer.step()` if given) and measure it.

    `inputs`: a tensor, a tuple of positional arguments or a dict of keyword arguments.
    `loss_fn(output) -> scalar`; default: `output.loss` or the sum of the first tensor output.
    The step is real: gradients accumulate into `.grad` and the optimizer updates the weights, so
    pass a copy if the model must stay untouched. `track_live` also reports live-tensor bytes after
    forward and their peak over the step (a dispatch mode; a few % slower). `exclude`: tensors or
    modules whose storages never count as activations (e.g. the input batch, to count only what
    the model itself adds).
    """
    params = [p for p in model.parameters()]
    param_keys = storage_keys([model, *exclude])
    path_of = {id(m): name for name, m in model.named_modules()}
    stack: list[str] = []

    def pre(mod: nn.Module, _args: Any) -> None:
        stack.append(path_of.get(id(mod), "?"))

    def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))

    cuda = any(p.is_cuda for p in params)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    live = LiveTensorBytes() if track_live else None
    rec = SavedTensorRecorder(exclude=param_keys, current_module=lambda: stack[-1] if stack else "")
    try:
        if live is not None:
            live.__enter__()
        try:
            with torch.enable_grad(), rec:
                out = _call(model, inputs)
                loss = (loss_fn or default_loss)(out)
            live_after = live.current if live is not None else None
            activations = rec.total_bytes
            act_per_module = rec.per_module()
            loss.backward()
            del loss, out
            if optimizer is not None:
                optimizer.step()
        finally:
            if live is not None:
                live.__exit__(None, None, None)
    finally:
        for h in handles:
            h.remove()

    weights, wkeys = _bytes_of(params, set())
    grads, gkeys = _bytes_of([p.grad for p in params if p.grad is not None], set())
    opt_bytes = 0
    if optimizer is not None:
        state_tensors = [
            v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ]
        opt_bytes, _ = _bytes_of(state_tensors, wkeys | gkeys)

    per_module: dict[str, dict[str, int]] = {}
    seen: set = set()
    for mpath, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            k = storage_key(p)
            if k is None or k in seen:
                continue
            seen.add(k)
            row = per_module.setdefault(mpath, {})
            row["weights"] = row.get("weights", 0) + p.untyped_storage().nbytes()
            if p.grad is not None:
                row["grads"] = row.get("grads", 0) + p.grad.untyped_storage().nbytes()
    for mpath, n in act_per_module.items():
        per_module.setdefault(mpath, {})["activations"] = n

    return MemoryBreakdown(
        weights=weights,
        grads=grads,
        optimizer_state=opt_bytes,
        activations=activations,
        per_module=per_module,
        live_after_forward=live_after,
        peak_live=live.peak if live is not None else None,
        cuda_peak_allocated=torch.cuda.max_memory_allocated() if cuda else None,
        device=str(params[0].device) if params else "cpu",
    )
