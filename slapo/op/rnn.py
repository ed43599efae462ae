"""Fused LSTM and GRU (EcoRNN, arXiv 1805.08899): drop-ins for `nn.LSTM` / `nn.GRU`.

Why: a framework RNN runs, per time step, one recurrent GEMM plus a dozen tiny elementwise ops,
and autograd keeps the input of every one of them. EcoRNN's two optimisations are rebuilt here:

1. **Fusion.** The input projection `x @ W_ih^T` of all time steps is one GEMM (cuDNN's trick).
   The recurrence is then ONE autograd node per sequence (`LSTMSequenceFunction` /
   `GRUSequenceFunction`): per step one recurrent GEMM (accumulating into the projected input)
   and the fused nonlinear block, outside autograd; its hand-written backward (EcoRNN's
   `lstm_nonlin_block`: `lstm_cell_grads`, using tanh(c_t), not tanh(c_{t-1})) runs the steps in
   reverse and computes the recurrent weight gradient of all steps as one GEMM. Saved per step:
   LSTM the activated gates plus c_t and h_t (6·B·H, h_t being the output anyway); GRU r, z, n,
   the recurrent candidate pre-activation and h_t (5·B·H); autograd through `nn.LSTM`'s CPU
   path keeps more than twice that. `compile_cell=True` instead runs each step (GEMM +
   nonlinearity) through `torch.compile` under autograd (one graph per step shape; Inductor
   fuses the elementwise ops and AOT autograd picks what to save); it warns once and stays
   eager if compiling fails.
2. **Layout** (`layout=`), EcoRNN's knob for the skinny recurrent GEMM (small batch, wide 4H):
   which operand is transposed and whether the state is stored [B, H] or [H, B]:

   * `"gates_major"` (default): gate rows as `nn.LSTM` stores them ([gate][unit]), state [B, H],
     `W_hh^T` pre-transposed once per forward so the step GEMM is `h @ W^T` on contiguous
     operands;
   * `"hidden_major"`: gate rows interleaved per unit ([unit][gate]), so the four (three)
     pre-activations of one hidden unit are adjacent and the nonlinear block reads one
     contiguous run per unit; state [B, H];
   * `"batch_minor"`: state stored transposed [H, B] (batch innermost), the step GEMM is
     `W_hh @ h` with `W_hh` untransposed, and each gate is a contiguous block of rows.

   Parameters always keep `nn.LSTM`'s layout and names (the compute layout is a permutation or
   transpose made once per forward, and gradients flow back through it), so state_dicts load
   both ways and optimizers see the same tensors. Every layout is exact in fp32: it moves the
   same products around, so results equal `nn.LSTM` up to summation-order rounding (~1e-7
   relative).

**Checkpointing over time** (`ckpt_chunk=k`): each chunk of k steps (its input projection
included) runs under non-reentrant `torch.utils.checkpoint`; only the chunk's input slice and
the (h, c) at chunk boundaries are kept, and backward recomputes one chunk at a time. Saved
activations drop from ~6·B·H per step to ~2·B·H per chunk (plus the layer input, which the
previous layer keeps anyway); the input projection then runs per chunk (k·B rows per GEMM).

Supported: 1-N layers, `bias`, `batch_first`, `bidirectional`, inter-layer `dropout` (training
mode; masks come from `F.dropout` between layers, so they are not the same draws as `nn.LSTM`'s),
unbatched 2-D input, an initial state. Not supported (a clear error): `PackedSequence` input
(pad it: `nn.utils.rnn.pad_packed_sequence`) and `proj_size > 0`. Devices: any; dtype: any
floating type (tests run fp32 on CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..errors import SchedulingError
from .rnn_kernels import GATES, check_knobs, run_direction


# ---- the modules --------------------------------------------------------------------------------
class _FusedRNNBase(nn.Module):
    """Shared by `FusedLSTM` / `FusedGRU`: `nn.LSTM`'s constructor, attributes, parameter names
    (`weight_ih_l{k}[_reverse]`, ...) and registration order, so state_dicts are identical."""

    mode = ""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, *, layout: str = "gates_major",
                 compile_cell: bool = False, ckpt_chunk: int | None = None):
        super().__init__()
        check_knobs(layout, compile_cell, ckpt_chunk)
        if not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"Fused{self.mode}: dropout must be in [0, 1], got {dropout}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, 0
        self.layout, self.compile_cell, self.ckpt_chunk = layout, compile_cell, ckpt_chunk
        self._flat_weights_names: list[str] = []
        g, kw = GATES[self.mode] * hidden_size, {"device": device, "dtype": dtype}
        for layer in range(num_layers):
            for suffix in self._suffixes():
                n_in = input_size if layer == 0 else hidden_size * self.num_directions
                shapes = [("weight_ih", (g, n_in)), ("weight_hh", (g, hidden_size))]
                if bias:
                    shapes += [("bias_ih", (g,)), ("bias_hh", (g,))]
                for kind, shape in shapes:
                    name = f"{kind}_l{layer}{suffix}"
                    setattr(self, name, nn.Parameter(torch.empty(shape, **kw)))
                    self._flat_weights_names.append(name)
        self.reset_parameters()

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def reset_parameters(self) -> None:
        """`nn.LSTM`'s init: U(-1/sqrt(H), 1/sqrt(H)) for every weight and bias."""
        if any(p.is_meta for p in self.parameters()):
            return
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """No-op (cuDNN's weight flattening does not apply); user code calling it keeps working."""

    @classmethod
    def from_module(cls, rnn: nn.Module, *, layout: str = "gates_major",
                    compile_cell: bool = False, ckpt_chunk: int | None = None):
        """The fused twin of `rnn` (an `nn.LSTM` / `nn.GRU`) holding the *same* Parameter
        objects, so an optimizer or a tied reference keeps working after the swap."""
        if getattr(rnn, "proj_size", 0):
            raise SchedulingError("", f"nn.LSTM with proj_size={rnn.proj_size} is not supported "
                                  "by the fused LSTM.", "keep nn.LSTM for this module.")
        new = cls(rnn.input_size, rnn.hidden_size, rnn.num_layers, rnn.bias, rnn.batch_first,
                  rnn.dropout, rnn.bidirectional, device="meta", layout=layout,
                  compile_cell=compile_cell, ckpt_chunk=ckpt_chunk)
        for name in new._flat_weights_names:
            setattr(new, name, getattr(rnn, name))
        new.train(rnn.training)
        return new

    def _params(self, layer: int, suffix: str) -> tuple:
        names = ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
        return tuple(getattr(self, f"{n}_l{layer}{suffix}", None) if self.bias or i < 2
                     else None for i, n in enumerate(names))

    def _check_input(self, x) -> None:
        if isinstance(x, PackedSequence):
            raise SchedulingError("", f"Fused{self.mode} does not take a PackedSequence.",
                                  "pad the batch (nn.utils.rnn.pad_packed_sequence) and pass the "
                                  "padded tensor, or keep nn." + self.mode + " for this module.")
        if x.dim() not in (2, 3) or x.shape[-1] != self.input_size:
            raise ValueError(f"Fused{self.mode}: expected input [T, B, {self.input_size}] "
                             f"(or batch_first / unbatched), got {tuple(x.shape)}")

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.num_layers * self.num_directions, x.shape[1], self.hidden_size)

    def _run(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None):
        """All layers over time-major x; returns (output, h_n, c_n) (c_n None for a GRU)."""
        hs, cs = [], []
        for layer in range(self.num_layers):
            ys = []
            for d, suffix in enumerate(self._suffixes()):
                i = layer * self.num_directions + d
                y, h, c = run_direction(
                    self.mode, self.layout, x, h0[i], c0[i] if c0 is not None else None,
                    self._params(layer, suffix), reverse=d == 1,
                    compile_cell=self.compile_cell, ckpt_chunk=self.ckpt_chunk)
                ys.append(y)
                hs.append(h)
                cs.append(c)
            x = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, True)
        return x, torch.stack(hs), (torch.stack(cs) if c0 is not None else None)

    def _forward(self, x: torch.Tensor, hx: tuple | None):
        """(output, h_n, c_n) for a padded tensor x (any of the input forms `nn.LSTM` takes)."""
        self._check_input(x)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1)
            hx = tuple(t.unsqueeze(1) for t in hx) if hx is not None else None
        elif self.batch_first:
            x = x.transpose(0, 1)
        if hx is None:
            hx = (self._zeros(x),) * (2 if self.mode == "LSTM" else 1)
        out, h, c = self._run(x, hx[0], hx[1] if self.mode == "LSTM" else None)
        if unbatched:
            return out.squeeze(1), h.squeeze(1), (c.squeeze(1) if c is not None else None)
        return (out.transpose(0, 1) if self.batch_first else out), h, c

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        for k, default in (("bias", True), ("batch_first", False), ("dropout", 0.0),
                           ("bidirectional", False)):
            if getattr(self, k) != default:
                s += f", {k}={getattr(self, k)}"
        s += f", layout={self.layout!r}"
        if self.compile_cell:
            s += ", compile_cell=True"
        if self.ckpt_chunk is not None:
            s += f", ckpt_chunk={self.ckpt_chunk}"
        return s


class FusedLSTM(_FusedRNNBase):
    """Drop-in for `nn.LSTM` (same arguments, parameters, state_dict and outputs
    `(output, (h_n, c_n))`) with EcoRNN's fusion, layouts and time-chunk checkpointing (module
    docstring). `FusedLSTM.from_module(lstm, layout=..., compile_cell=..., ckpt_chunk=...)`."""

    mode = "LSTM"

    def forward(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None):
        out, h, c = self._forward(input, hx)
        return out, (h, c)


class FusedGRU(_FusedRNNBase):
    """Drop-in for `nn.GRU` (same arguments, parameters, state_dict and outputs
    `(output, h_n)`) with EcoRNN's fusion, layouts and time-chunk checkpointing (module
    docstring). `FusedGRU.from_module(gru, layout=..., compile_cell=..., ckpt_chunk=...)`."""

    mode = "GRU"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None):
        out, h, _ = self._forward(input, (hx,) if hx is not None else None)
        return out, h


FUSED = {nn.LSTM: FusedLSTM, nn.GRU: FusedGRU}
