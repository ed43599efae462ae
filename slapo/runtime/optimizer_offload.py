"""Optimizer offload: the optimizer's state and step in host memory (`build(optimizer_offload=True)`).

AdamW keeps two fp32 tensors per parameter (`exp_avg`, `exp_avg_sq`): twice the weights' bytes
of accelerator memory that no forward or backward reads. DeepSpeed's ZeRO-Offload, Megatron's
and FSDP2's CPU offload move them to host memory and step there. `HostOffloadOptimizer` does it
for any `torch.optim.Optimizer` class, around the step `build` already composes:

- **host copies**: for every parameter the optimizer steps, a host tensor of the parameter's
  local values (its FSDP2 shard or TP shard: what this rank holds) and a host gradient buffer,
  both pinned when the parameter is on CUDA. The user's optimizer class is built over the host
  copies (`inner`), so its state (`exp_avg`, `exp_avg_sq`, `step`) lives on the host too.
- **the step** (`step()`, called where the device optimizer's would be: after backward, the
  data-parallel reduction, the fp16 unscale and the gradient clipping): each parameter that
  has a gradient, and the gradient, copied to the host (non-blocking), one synchronisation, the
  learning rate and every other
  hyper-parameter of `param_groups` copied to the host optimizer (the loop sets
  `group["lr"]` on this object each step), `inner.step()` on the host, and each updated
  parameter copied back into the device parameter (non-blocking, in place: DDP's buckets and
  FSDP2's shards keep their storage). Parameters without a gradient are not stepped, as
  torch's optimizers skip them.
- **the device weights are the master**: each step copies the parameter to its host copy along
  with its gradient, so weights changed outside the step (a checkpoint loaded, an edit) are
  always what is stepped. Cheaper schemes were tried and dropped: a check of the parameter's
  version counter (`Tensor._version`) misses DCP's in-place load into FSDP2 shards (no version
  bump, torch 2.13: a resumed FSDP2 run silently stepped its pre-load weights). Per step
  and parameter this moves the gradient and the weight to the host and the weight back
  (3 x the weights' bytes over PCIe with fp32 weights).
- **state dicts** are the device optimizer's: `param_groups` hold the device parameters and
  `state[device_param]` is the host optimizer's state (the same dict), so torch's
  `get_state_dict` / `set_state_dict` and the DCP checkpoints of `slapo train` save and load it
  under the parameters' names. Under FSDP2 the moments are handed out as DTensors of the
  parameter's layout (over their host shards), so each rank saves its own shard.

Master weights: Slapo keeps weights fp32 under every precision (autocast computes in
bf16/fp16), so the host copy *is* the fp32 master, equal to the device weight after each step;
a model whose parameters were cast to bf16 is stepped in bf16, as without offload. Host memory:
the parameter copy, its gradient and the state (AdamW: 4 x the weights' bytes this rank holds).

Host optimizer kernels: torch's optimizers default to their one-tensor-at-a-time loop on CPU
tensors; without `foreach` or `fused` in `optimizer_kwargs` the host optimizer gets
`foreach=True` (measured bit-identical to that loop for AdamW on torch 2.13); `fused=True` runs
torch's fused CPU kernel (fastest, not bit-identical to the loop).

On CPU the "device" and the host are the same memory, but the copies are real: distinct
tensors, so the data flow runs (and is tested) on CPU exactly as on a GPU. Not yet run on a GPU:
the copies run on the current stream (no side stream, no overlap of the host step with the
next forward), and their cost is unmeasured.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import SchedulingError

# the group keys that are not hyper-parameters (the parameters, and torch's names for them)
_NOT_HYPER = ("params", "param_names")


def check_optimizer_offload(offload, optimizer, target: str | None) -> None:
    """`build(optimizer_offload=...)`'s arguments, before anything changes."""
    if not isinstance(offload, bool):
        raise SchedulingError("", f"optimizer_offload={offload!r} must be True or False.",
                              "pass optimizer_offload=True to keep the optimizer state in "
                              "host memory.")
    if not offload:
        return
    if target == "deepspeed":
        raise SchedulingError("", "optimizer_offload=True with target='deepspeed': DeepSpeed "
                              "offloads with its own engine.", "drop optimizer_offload and put "
                              "{'zero_optimization': {'stage': 2, 'offload_optimizer': "
                              "{'device': 'cpu'}}} in deepspeed_config.")
    if optimizer is None:
        raise SchedulingError("", "optimizer_offload=True needs an optimizer to offload.",
                              "pass optimizer=torch.optim.AdamW (or drop optimizer_offload).")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise SchedulingError("", f"optimizer_offload=True builds the optimizer over host "
                              f"copies of the parameters and needs a torch.optim.Optimizer "
                              f"class, got {optimizer!r}.", "pass the class (e.g. "
                              "optimizer=torch.optim.AdamW) and its arguments in "
                              "optimizer_kwargs.")


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (FSDP2), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


@dataclass
class _Mirror:
    """One parameter: the device parameter, its host copy and host gradient buffer."""

    param: nn.Parameter
    host: torch.Tensor
    grad: torch.Tensor | None


class HostOffloadOptimizer(torch.optim.Optimizer):
    """`optimizer_cls(params, **kwargs)` stepped in host memory (see the module docstring).

    `param_groups` hold the device parameters (set `group["lr"]` here, as on any optimizer);
    `inner` is the user's optimizer over the host copies; `state[p]` is `inner`'s state of
    `p`'s host copy (the same dict)."""

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": _as_list(g["params"])} for g in groups]
        self._mirrors: list[_Mirror] = []
        self._forced = _host_defaults(optimizer_cls, kwargs)
        self._cuda = sorted({str(_local(p).device) for g in groups for p in g["params"]
                             if _local(p).is_cuda})
        host_groups = [{**g, "params": [self._mirror(p) for p in g["params"]]} for g in groups]
        self.inner = optimizer_cls(host_groups, **{**kwargs, **self._forced})
        super().__init__(groups, self.inner.defaults)
        self._ready = True
        self._pull_hyperparameters()

    def __repr__(self) -> str:
        return f"HostOffloadOptimizer({self.inner!r})"

    # ---- the host copies -----------------------------------------------------------------------
    @torch.no_grad()
    def _mirror(self, p: torch.Tensor) -> torch.Tensor:
        local = _local(p)
        pin = bool(self._cuda)
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        host.copy_(local)
        host.requires_grad_(p.requires_grad)
        grad = torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin) \
            if p.requires_grad else None
        self._mirrors.append(_Mirror(p, host, grad))
        return host

    def add_param_group(self, param_group: dict) -> None:
        """A group added after construction gets host copies and joins `inner` too."""
        if getattr(self, "_ready", False):
            params = _as_list(param_group["params"])
            param_group = {**param_group, "params": params}
            self.inner.add_param_group({**param_group,
                                        "params": [self._mirror(p) for p in params]})
            super().add_param_group(param_group)
            self._pull_hyperparameters()
        else:
            super().add_param_group(param_group)

    def _param_to_host(self, m: _Mirror) -> None:
        """Copy the device parameter (the master) into its host copy."""
        m.host.copy_(_local(m.param), non_blocking=True)

    def _grad_to_host(self, m: _Mirror) -> None:
        """Copy the device gradient into the host buffer (the step's only gradient input)."""
        m.grad.copy_(_local(m.param.grad), non_blocking=True)
        m.host.grad = m.grad

    def _param_to_device(self, m: _Mirror) -> None:
        """Copy the stepped host copy back into the device parameter, in place."""
        # under no_grad `_local` is the parameter's own (local) tensor: written in place
        _local(m.param).copy_(m.host, non_blocking=True)

    def _wait(self) -> None:
        """The host may read the copies' results (CUDA: the copies ran on the current
        stream; on CPU they are done)."""
        for device in self._cuda:
            torch.cuda.current_stream(torch.device(device)).synchronize()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []
        for m in self._mirrors:
            if m.param.grad is None:
                m.host.grad = None
                continue
            self._param_to_host(m)
            self._grad_to_host(m)
            stepped.append(m)
        self._wait()
        self._push_hyperparameters()
        self.inner.step()
        for m in stepped:
            self._param_to_device(m)
            m.host.grad = None
        self._link_state()
        return loss

    def _push_hyperparameters(self) -> None:
        """The learning rate (and every other hyper-parameter) as set on `param_groups`."""
        for group, host in zip(self.param_groups, self.inner.param_groups, strict=True):
            host.update({k: v for k, v in group.items() if k not in _NOT_HYPER})

    def _pull_hyperparameters(self) -> None:
        for group, host in zip(self.param_groups, self.inner.param_groups, strict=True):
            group.update({k: v for k, v in host.items() if k not in _NOT_HYPER})

    def _link_state(self) -> None:
        """`state[device param]` is the host optimizer's state of its host copy."""
        for m in self._mirrors:
            s = self.inner.state.get(m.host)
            if s is not None:
                self.state[m.param] = s

    # ---- state dicts ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The device optimizer's state dict (indices of `param_groups`' parameters), with the
        host state; a DTensor parameter's moments as DTensors of its layout (DCP then saves
        each rank's shard)."""
        sd = super().state_dict()
        index = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        for m in self._mirrors:
            i = index[id(m.param)]
            if _is_dtensor(m.param) and i in sd["state"]:
                sd["state"][i] = {k: _as_dtensor_like(v, m) for k, v in sd["state"][i].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the host optimizer (values are cast to the host copies' device, as torch
        casts to the parameters'), then take its hyper-parameters (the host kernels kept)."""
        state = {k: ({n: _local(v) if _is_dtensor(v) else v for n, v in entry.items()}
                     if isinstance(entry, dict) else entry)
                 for k, entry in state_dict["state"].items()}
        self.inner.load_state_dict({**state_dict, "state": state})
        for host in self.inner.param_groups:
            host.update(self._forced)
        self._pull_hyperparameters()
        self.state.clear()
        self._link_state()


def _as_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _host_defaults(optimizer_cls: type, kwargs: dict) -> dict:
    """`foreach=True` when the class takes it and the caller chose no kernel (see the module
    docstring); nothing otherwise."""
    if "foreach" in kwargs or "fused" in kwargs:
        return {}
    try:
        takes = "foreach" in inspect.signature(optimizer_cls.__init__).parameters
    except (TypeError, ValueError):
        takes = False
    return {"foreach": True} if takes else {}


def _as_dtensor_like(value, m: _Mirror):
    """A host state tensor of the parameter's local shape as a DTensor of the parameter's
    layout, over the same host memory (FSDP2 builds its CPU-offloaded shards the same way);
    scalars (`step`) and anything else as they are."""
    if not (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == m.host.shape):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor(value, m.param._spec, requires_grad=False)


# host bytes per parameter element held by the offload: the fp32 copy and gradient buffer,
# and two fp32 moments (AdamW's; an optimizer with less state needs less)
HOST_BYTES_PER_ELEMENT = 16


def host_memory_available() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_budget(params: list[nn.Parameter], available: int | None = None) -> int:
    """Refuse an offload whose host state does not fit: this rank's parameter elements x
    `HOST_BYTES_PER_ELEMENT`, times the ranks of this host (`LOCAL_WORLD_SIZE`, as torchrun
    sets it: they share its memory), against the host's available memory. Checked before any
    host buffer is allocated (the alternative is the kernel's OOM killer mid-run). Returns the
    bytes this rank needs."""
    import os

    need = sum(_local(p).numel() for p in params) * HOST_BYTES_PER_ELEMENT
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    available = host_memory_available() if available is None else available
    if available is not None and need * ranks > available:
        raise SchedulingError("", f"optimizer_offload needs {need * ranks / 2**30:.2f} GiB of "
                              f"host memory ({need / 2**30:.2f} GiB per rank x {ranks} rank(s) "
                              f"on this host: a host copy, a gradient buffer and the optimizer "
                              f"state per parameter), but {available / 2**30:.2f} GiB is "
                              "available.", "shard the model over more ranks or hosts "
                              "(FSDP2: --dp-shard), free host memory, or train without "
                              "optimizer_offload.")
    return need


def make_offloaded(optimizer_cls: type[torch.optim.Optimizer], params: list[nn.Parameter],
                   optimizer_kwargs: dict | None) -> HostOffloadOptimizer:
    """`build`'s optimizer with `optimizer_offload=True` (its host state checked to fit:
    `check_host_budget`)."""
    check_host_budget(params)
    return HostOffloadOptimizer(params, optimizer_cls, **(optimizer_kwargs or {}))


__all__ = ["HostOffloadOptimizer", "check_host_budget", "check_optimizer_offload",
           "host_memory_available", "make_offloaded"]
