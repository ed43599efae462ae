"""The fused LSTM/GRU recurrence of `slapo.op.rnn` (EcoRNN, arXiv 1805.08899): compute layouts,
the one-autograd-node-per-sequence functions with their hand-written backward, the compiled
per-step path and the time loop with checkpointing over chunks.

Why apart from `rnn.py`: this file is the numerics (what runs per step and what is saved); the
modules in `rnn.py` are `nn.LSTM`'s interface (constructor, parameter names, state_dict) around
`run_direction`. The design is described once, in `rnn.py`'s docstring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..errors import SchedulingError

LAYOUTS = ("gates_major", "hidden_major", "batch_minor")
GATES = {"LSTM": 4, "GRU": 3}


def check_knobs(layout: str, compile_cell: bool, ckpt_chunk: int | None, path: str = "") -> None:
    """Raise a `SchedulingError` for a knob value the fused RNN cannot run (before any change)."""
    if layout not in LAYOUTS:
        raise SchedulingError(path, f"unknown RNN layout {layout!r}.", f"use one of {LAYOUTS}.")
    if not isinstance(compile_cell, bool):
        raise SchedulingError(path, f"compile_cell must be True or False, got {compile_cell!r}.",
                              "pass a bool.")
    if ckpt_chunk is not None and (isinstance(ckpt_chunk, bool) or not isinstance(ckpt_chunk, int)
                                   or ckpt_chunk < 1):
        raise SchedulingError(path, f"ckpt_chunk must be a positive int (time steps per "
                              f"recomputed chunk) or None, got {ckpt_chunk!r}.",
                              "pass e.g. ckpt_chunk=16, or None for no checkpointing.")


# ---- layouts --------------------------------------------------------------------------------
class _Layout:
    """How one direction of one layer lays out its weights, gate pre-activations and state.

    `weights` runs once per forward (differentiable permutes/transposes of the parameters);
    `project` is the input GEMM of a run of steps, `recur` the recurrent GEMM of one step
    (`acc` is added into it: the LSTM's projected input, so the add is fused in the GEMM)."""

    name = ""

    def weights(self, w: torch.Tensor, b: torch.Tensor | None, gates: int, recurrent: bool):
        raise NotImplementedError

    def project(self, x, w, b):
        return F.linear(x, w, b)                                 # [t, B, G*H]

    def recur(self, h, w, b, acc=None):
        base = acc if acc is not None else b
        return h @ w if base is None else torch.addmm(base, h, w)   # [B, G*H]

    def split(self, a: torch.Tensor, gates: int) -> tuple[torch.Tensor, ...]:
        return a.chunk(gates, -1)

    def grad_h(self, d_a, w):
        """d(recur)/dh for the gate gradient d_a of one step."""
        return d_a @ w.t()

    def grad_w(self, hs, d_a):
        """d(recur)/dw summed over all steps: one GEMM over (time x batch)."""
        return hs.flatten(0, -2).t() @ d_a.flatten(0, -2)

    def state_in(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def state_out(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def seq_out(self, ys: torch.Tensor) -> torch.Tensor:
        return ys


class _GatesMajor(_Layout):
    name = "gates_major"

    def weights(self, w, b, gates, recurrent):
        return (w.t().contiguous() if recurrent else w), b


def _interleave(t: torch.Tensor, gates: int) -> torch.Tensor:
    """Rows [gate][unit] -> [unit][gate] (works for a weight matrix and a bias vector)."""
    h = t.shape[0] // gates
    return t.unflatten(0, (gates, h)).transpose(0, 1).flatten(0, 1)


class _HiddenMajor(_Layout):
    name = "hidden_major"

    def weights(self, w, b, gates, recurrent):
        w = _interleave(w, gates)
        b = _interleave(b, gates) if b is not None else None
        return (w.t().contiguous() if recurrent else w.contiguous()), b

    def split(self, a, gates):
        return a.unflatten(-1, (-1, gates)).unbind(-1)


class _BatchMinor(_Layout):
    name = "batch_minor"

    def weights(self, w, b, gates, recurrent):
        return w, (b.unsqueeze(-1) if b is not None else None)   # W @ h; bias [G*H, 1]

    def project(self, x, w, b):
        y = torch.matmul(w, x.transpose(-1, -2))                 # [t, G*H, B]
        return y if b is None else y + b

    def recur(self, h, w, b, acc=None):
        base = acc if acc is not None else b
        return w @ h if base is None else torch.addmm(base, w, h)   # [G*H, B]

    def split(self, a, gates):
        return a.chunk(gates, -2)

    def grad_h(self, d_a, w):
        return w.t() @ d_a

    def grad_w(self, hs, d_a):          # sum_t d_a[t] @ h[t]^T as one GEMM over (time x batch)
        return d_a.transpose(0, 1).flatten(1) @ hs.transpose(0, 1).flatten(1).t()

    def state_in(self, h):
        return h.t().contiguous()

    def state_out(self, h):
        return h.t()

    def seq_out(self, ys):
        return ys.transpose(-1, -2)


_LAYOUT_OBJ = {cls.name: cls() for cls in (_GatesMajor, _HiddenMajor, _BatchMinor)}


# ---- fused recurrence: one autograd node per sequence, hand-written backward ----------------
def lstm_cell_grads(i, f, g, o, c_prev, c, dh, dc):
    """EcoRNN's fused LSTM backward for one step: (da_i, da_f, da_g, da_o, dc_prev) from the
    activated gates, c_{t-1}, c_t and the incoming dh, dc (uses tanh(c_t), not tanh(c_{t-1}))."""
    tc = torch.tanh(c)
    dc = dc + dh * o * (1 - tc * tc)
    return (dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
            dh * tc * o * (1 - o), dc * f)


class LSTMSequenceFunction(torch.autograd.Function):
    """The LSTM recurrence over a whole (chunk of a) sequence, as cuDNN and EcoRNN run it.

    forward(layout, xp [T, gates], h0, c0, w_hh in the layout) -> (ys [T, state], h_T, c_T).
    Per step: one recurrent GEMM (accumulating into the projected input) and the fused
    nonlinear block, outside autograd. Saved: the activated gates (4·B·H per step), every c and
    h (B·H each per step; the h's are also the output). Backward runs the steps in reverse with
    `lstm_cell_grads`, then the weight gradient of all steps as ONE GEMM (per-step weight
    gradients would be T skinny GEMMs plus T accumulations)."""

    @staticmethod
    def forward(ctx, layout: str, xp, h0, c0, wh):
        lay = _LAYOUT_OBJ[layout]
        h, c, hs, cs, gates = h0, c0, [h0], [c0], []
        for x_t in xp.unbind(0):
            a = lay.recur(h, wh, None, acc=x_t)
            i, f, g, o = lay.split(a, 4)
            i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
            c = torch.addcmul(f * c, i, g)
            h = o * torch.tanh(c)
            gates.append(a)
            hs.append(h)
            cs.append(c)
        hs_t, cs_t = torch.stack(hs), torch.stack(cs)
        ctx.layout = layout
        ctx.save_for_backward(torch.stack(gates), hs_t, cs_t, wh)
        return hs_t[1:], h.clone(), c.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dys, dh_n, dc_n):
        lay = _LAYOUT_OBJ[ctx.layout]
        gates, hs, cs, wh = ctx.saved_tensors
        d_a = torch.empty_like(gates)
        dh, dc = dh_n, dc_n
        for t in range(gates.shape[0] - 1, -1, -1):
            dh = dh + dys[t]
            grads = lstm_cell_grads(*lay.split(gates[t], 4), cs[t], cs[t + 1], dh, dc)
            for view, grad in zip(lay.split(d_a[t], 4), grads[:4]):
                view.copy_(grad)
            dc = grads[4]
            dh = lay.grad_h(d_a[t], wh)
        return None, d_a, dh, dc, lay.grad_w(hs[:-1], d_a)


class GRUSequenceFunction(torch.autograd.Function):
    """The GRU recurrence over a whole (chunk of a) sequence (PyTorch's GRU equations).

    forward(layout, gi [T, gates] (input projection + b_ih), h0, w_hh, b_hh) -> (ys, h_T).
    Saved per step: r and z (written over the recurrent pre-activations they came from), the
    recurrent candidate pre-activation gh_n, n, and h_{t-1}: 5·B·H. Backward as the LSTM's:
    steps in reverse, then one GEMM for the weight gradient and one sum for b_hh's."""

    @staticmethod
    def forward(ctx, layout: str, gi, h0, wh, bh):
        lay = _LAYOUT_OBJ[layout]
        h, hs, ghs, ns = h0, [h0], [], []
        for x_t in gi.unbind(0):
            gh = lay.recur(h, wh, bh)
            xr, xz, xn = lay.split(x_t, 3)
            hr, hz, hn = lay.split(gh, 3)
            r, z = hr.add_(xr).sigmoid_(), hz.add_(xz).sigmoid_()
            n = torch.tanh(torch.addcmul(xn, r, hn))
            h = torch.addcmul(n, z, h - n)
            ghs.append(gh)
            ns.append(n)
            hs.append(h)
        hs_t = torch.stack(hs)
        ctx.layout, ctx.has_bias = layout, bh is not None
        ctx.save_for_backward(torch.stack(ghs), torch.stack(ns), hs_t, wh)
        ctx.bias_shape = bh.shape if bh is not None else None
        return hs_t[1:], h.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dys, dh_n):
        lay = _LAYOUT_OBJ[ctx.layout]
        ghs, ns, hs, wh = ctx.saved_tensors
        d_gi, d_gh = torch.empty_like(ghs), torch.empty_like(ghs)
        dh = dh_n
        for t in range(ghs.shape[0] - 1, -1, -1):
            dh = dh + dys[t]
            r, z, hn = lay.split(ghs[t], 3)
            n, h_prev = ns[t], hs[t]
            da_n = dh * (1 - z) * (1 - n * n)
            da_z = dh * (h_prev - n) * z * (1 - z)
            da_r = da_n * hn * r * (1 - r)
            for view, grad in zip((*lay.split(d_gi[t], 3), *lay.split(d_gh[t], 3)),
                                  (da_r, da_z, da_n, da_r, da_z, da_n * r)):
                view.copy_(grad)
            dh = dh * z + lay.grad_h(d_gh[t], wh)
        d_bh = d_gh.sum(0).sum_to_size(ctx.bias_shape) if ctx.has_bias else None
        return None, d_gi, dh, lay.grad_w(hs[:-1], d_gh), d_bh


# ---- plain-op steps, for torch.compile --------------------------------------------------------
def _lstm_step_ops(layout: _Layout, xp, h, c, w, b):
    i, f, g, o = layout.split(layout.recur(h, w, b, acc=xp), 4)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_step_ops(layout: _Layout, xp, h, c, w, b):
    xr, xz, xn = layout.split(xp, 3)
    hr, hz, hn = layout.split(layout.recur(h, w, b), 3)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return (1 - z) * n + z * h, None


_STEPS = {"LSTM": _lstm_step_ops, "GRU": _gru_step_ops}
# Non-reentrant checkpoint ends a recomputation early by raising this through the step; it is
# control flow, not a compile failure, so the compiled step must let it pass.
_CONTROL_FLOW = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError",
                                          None),) if c is not None)


class _CompiledStep:
    """The step through `torch.compile` (one graph per step shape, `dynamic=False`); if
    compiling fails it warns once and runs eagerly, so results never depend on it (as
    `slapo.op.fused`'s epilogues). Checkpoint's control-flow exception passes through."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=False)
            return self.compiled(*args)
        except _CONTROL_FLOW:
            raise
        except Exception as e:  # no C++ compiler / Triton, unsupported backend, ...
            self.failed = True
            warnings.warn(f"{self.name}: torch.compile failed ({type(e).__name__}: {e}); "
                          "running eagerly.", stacklevel=3)
            return self.fn(*args)


_COMPILED: dict[str, _CompiledStep] = {}


def compiled_step(mode: str) -> _CompiledStep:
    """The plain-op step of `mode` through torch.compile (one shared wrapper per mode)."""
    if mode not in _COMPILED:
        _COMPILED[mode] = _CompiledStep(_STEPS[mode], f"Fused{mode} cell")
    return _COMPILED[mode]


# ---- the time loop ------------------------------------------------------------------------------
def _scan_compiled(mode, lay, xp, h, c, wh, bh):
    """The recurrence as T compiled steps under autograd (unbind, not xp[t]: an indexing op's
    backward would write a zero-filled full-size gradient per step)."""
    step, ys = compiled_step(mode), []
    for x_t in xp.unbind(0):
        h, c = step(lay, x_t, h, c, wh, bh)
        ys.append(h)
    return torch.stack(ys), h, c


def _run_chunk(mode, lay, compile_cell, reverse, x, h, c, wx, bx, wh, bh):
    """Project the chunk's inputs in one GEMM, then run its steps; returns (ys, h, c)."""
    xp = lay.project(x, wx, bx)
    if reverse:
        xp = xp.flip(0)
    if compile_cell:
        ys, h, c = _scan_compiled(mode, lay, xp, h, c, wh, bh)
    elif mode == "LSTM":
        ys, h, c = LSTMSequenceFunction.apply(lay.name, xp, h, c, wh)
    else:
        ys, h = GRUSequenceFunction.apply(lay.name, xp, h, wh, bh)
    return (ys.flip(0) if reverse else ys), h, c


def run_direction(mode: str, layout: str, x: torch.Tensor, h: torch.Tensor, c, params,
                  *, reverse: bool = False, compile_cell: bool = False,
                  ckpt_chunk: int | None = None):
    """One direction of one layer over time-major `x` [T, B, I] from state h, c [B, H].

    `params` = (w_ih, w_hh, b_ih, b_hh) in `nn.LSTM` layout (biases may be None). Returns
    (outputs [T, B, H], h_T, c_T) (c is None for a GRU)."""
    lay, gates = _LAYOUT_OBJ[layout], GATES[mode]
    w_ih, w_hh, b_ih, b_hh = params
    if mode == "LSTM" and b_ih is not None:  # both biases join the input projection
        b_ih, b_hh = b_ih + b_hh, None
    wx, bx = lay.weights(w_ih, b_ih, gates, recurrent=False)
    wh, bh = lay.weights(w_hh, b_hh, gates, recurrent=True)
    h = lay.state_in(h)
    c = lay.state_in(c) if c is not None else None
    T = x.shape[0]
    use_ckpt = ckpt_chunk is not None and torch.is_grad_enabled()
    k = ckpt_chunk if use_ckpt else T
    starts = list(range(0, T, k))
    outs: list[torch.Tensor] = []
    for s in reversed(starts) if reverse else starts:
        args = (mode, lay, compile_cell, reverse, x[s:s + k], h, c, wx, bx, wh, bh)
        if use_ckpt:
            ys, h, c = _checkpoint(_run_chunk, *args, use_reentrant=False,
                                   preserve_rng_state=False)
        else:
            ys, h, c = _run_chunk(*args)
        outs.append(ys)
    if reverse:
        outs.reverse()
    ys = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (lay.seq_out(ys), lay.state_out(h),
            lay.state_out(c) if c is not None else None)
