"""Tempo's fused kernels: Triton (interpreted on CPU) vs the PyTorch reference vs the plain op;
torch.compile without graph breaks; saved-for-backward bytes of BERT / GPT-2 layers.

The Triton tests run the very kernels CUDA runs, under `TRITON_INTERPRET=1` on tiny CPU tensors
(set before the kernels module is first imported); they skip cleanly without `triton`.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TRITON_INTERPRET"] = "1"  # before slapo.op.tempo_triton is first imported

from slapo.op import TempoGELU, TempoLayerNorm, apply_tempo_to_module  # noqa: E402
from slapo.op import tempo_kernels as tk  # noqa: E402
from slapo.op.kernels._common import triton_available, use_triton  # noqa: E402
from slapo.profile import saved_bytes  # noqa: E402

tg = sys.modules["slapo.op.tempo_gelu"]  # `slapo.op.tempo_gelu` is also a function name
tln = sys.modules["slapo.op.tempo_layernorm"]

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
HALF_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _grid(dtype: torch.dtype, approximate: str) -> torch.Tensor:
    """Inputs covering both branches, the ill-conditioned band around x_min and both tails."""
    x = torch.cat([
        torch.linspace(-12, 12, 1500),
        tg.X_MIN[approximate] + torch.linspace(-0.05, 0.05, 300),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0]),
    ])
    return x.to(dtype)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv("SLAPO_TRITON", "1")
    assert use_triton("auto", torch.zeros(1))


@needs_triton
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_triton_matches_reference_and_plain(triton_on_cpu, approximate, dtype):
    x = _grid(dtype, approximate)
    y_t, code_t = tk.gelu_fwd(x, approximate)
    y_r, code_r = tg.gelu_forward_reference(x, approximate)
    plain = F.gelu(x, approximate=approximate)
    # Forward: the same formula in fp32, rounded to the storage dtype.
    assert torch.allclose(y_t.float(), plain.float(), rtol=HALF_TOL[dtype], atol=1e-6)
    assert torch.equal(code_t & tg.RIGHT_BIT, code_r & tg.RIGHT_BIT)  # same branches
    # Backward: kernel and reference agree on the derivative; both within the documented bound
    # of the exact derivative at the (rounded) input.
    dy = torch.ones_like(x)
    dx_t = tk.gelu_bwd(dy, y_t, code_t, approximate).double()
    dx_r = tg.gelu_backward_reference(dy, y_r, code_r, approximate).double()
    exact = tg.gelu_derivative(x.double(), approximate)
    bound = 3e-6 if dtype == torch.float32 else 2.5e-4  # + the rounding of dx to the dtype
    rounding = exact.abs() * torch.finfo(dtype).eps
    assert ((dx_t - exact).abs() <= bound + rounding).all()
    assert ((dx_r - exact).abs() <= bound + rounding).all()
    # ... and against the plain op's own backward (it has rounding of its own in half precision).
    xr = x.clone().requires_grad_()
    F.gelu(xr, approximate=approximate).backward(dy)
    assert torch.allclose(dx_t, xr.grad.double(), rtol=HALF_TOL[dtype], atol=bound)
    # A random upstream gradient is applied elementwise.
    g = torch.randn_like(x)
    assert torch.allclose(tk.gelu_bwd(g, y_t, code_t, approximate).double(),
                          g.double() * dx_t, rtol=HALF_TOL[dtype], atol=1e-6)


@needs_triton
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_code_kernel_matches_reference(triton_on_cpu, approximate, dtype):
    """The compiled path's code-only kernel (y stored by inductor): same branches as the
    reference, and the derivative recovered from (y, its code) within the documented bound."""
    x = _grid(dtype, approximate)
    y = F.gelu(x, approximate=approximate)
    code_t = tk.gelu_code(x, y, approximate)
    code_r = tg.gelu_code_reference(x, y, approximate)
    assert torch.equal(code_t & tg.RIGHT_BIT, code_r & tg.RIGHT_BIT)
    exact = tg.gelu_derivative(x.double(), approximate)
    bound = 3e-6 if dtype == torch.float32 else 2.5e-4
    got = tk.gelu_bwd(torch.ones_like(x), y, code_t, approximate).double()
    assert ((got - exact).abs() <= bound + exact.abs() * torch.finfo(dtype).eps).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_module_on_triton_path(triton_on_cpu, dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 70) * 2).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y = TempoGELU()(x)
    ref = F.gelu(x2)
    g = torch.randn_like(y)
    (dx,), (dref,) = torch.autograd.grad(y, x, g), torch.autograd.grad(ref, x2, g)
    assert torch.allclose(y.float(), ref.float(), rtol=HALF_TOL[dtype], atol=1e-6)
    assert torch.allclose(dx.float(), dref.float(), rtol=HALF_TOL[dtype], atol=3e-3)


def _ln_inputs(dtype, n=48, rows=(3, 7), affine=True):
    torch.manual_seed(0)
    x = (torch.randn(*rows, n) * 3 + 1).to(dtype)
    w = (torch.rand(n) + 0.5) if affine else None
    b = torch.randn(n) if affine else None
    return x, w, b


@needs_triton
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_triton_matches_reference_and_plain(triton_on_cpu, dtype, affine):
    x, w, b = _ln_inputs(dtype, affine=affine)
    x2d = x.view(-1, x.shape[-1])
    y_t, ys_t, r_t = tk.layer_norm_fwd(x2d, w, b, 1e-5, dtype, dtype)
    y_r, ys_r, r_r = tln.layer_norm_forward_reference(x2d, w, b, 1e-5, dtype)
    assert ys_t is y_t
    assert torch.allclose(y_t.float(), y_r.float(), rtol=HALF_TOL[dtype], atol=1e-5)
    assert torch.allclose(r_t, r_r, rtol=1e-5)
    dy = torch.randn_like(x2d)
    got = tk.layer_norm_bwd(dy, ys_t, w, b, r_t, dtype)
    ref = tln.layer_norm_backward_reference(dy, ys_r, w, b, r_r, dtype)
    # The plain LayerNorm's autograd, in fp32 from the same (rounded) input.
    xp = x2d.float().requires_grad_()
    params = [p.clone().requires_grad_() for p in (w, b) if p is not None]
    wp, bp = (params + [None, None])[:2]
    yp = F.layer_norm(xp, [x.shape[-1]], wp, bp, 1e-5)
    plain = torch.autograd.grad(yp, [xp, *params], dy.float())
    tol = HALF_TOL[dtype] * 5
    for a, r in zip([t for t in got if t is not None], [t for t in ref if t is not None]):
        assert torch.allclose(a.float(), r.float(), rtol=tol, atol=tol)
    for a, p in zip([t for t in got if t is not None], plain):
        scale = p.abs().max()
        assert (a.float() - p).abs().max() <= tol * scale


@needs_triton
def test_layernorm_triton_half_save_under_autocast(triton_on_cpu):
    """Autocast: fp32 y returned (residual stream), bf16 copy saved, from one kernel pass."""
    x, w, b = _ln_inputs(torch.float32, n=40)
    ln = nn.LayerNorm(40)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    tln_mod = TempoLayerNorm.from_layernorm(copy.deepcopy(ln))
    lin = nn.Linear(40, 40)
    xt, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_t = lin(tln_mod(xt))
        out_r = lin(ln(xr))
        yt, yr = tln_mod(xt), ln(xr)
    assert yt.dtype == yr.dtype == torch.float32
    assert torch.allclose(yt, yr, atol=1e-5)
    g = torch.randn_like(out_t)
    gt = torch.autograd.grad(out_t, [xt, tln_mod.weight, tln_mod.bias], g)
    gr = torch.autograd.grad(out_r, [xr, ln.weight, ln.bias], g)
    for a, r in zip(gt, gr):
        assert (a - r).abs().max() <= 2e-2 * r.abs().max()


def test_layernorm_saves_half_copy_under_autocast():
    """What autocast LayerNorm keeps: fp32 x (4 B) normally, a bf16 y (2 B) with Tempo."""
    torch.manual_seed(0)
    ln, lin = nn.LayerNorm(64), nn.Linear(64, 64)
    tmod = TempoLayerNorm.from_layernorm(ln)
    x = torch.randn(8, 16, 64, requires_grad=True)
    n, rows = x.numel(), 8 * 16

    def run(norm):
        def fn(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return lin(norm(t * 1.0))  # t * 1.0: the LayerNorm input is not the leaf
        return fn

    base = saved_bytes(run(ln), x, exclude=[x, lin, ln])
    tempo = saved_bytes(run(tmod), x, exclude=[x, lin, tmod])
    # Both: the Linear's bf16 copies of y (2 B) and of its weight. Baseline: fp32 x + mean +
    # rstd; Tempo: bf16 y + rstd.
    w16 = 2 * 64 * 64
    assert base == w16 + 2 * n + 4 * n + 2 * 4 * rows
    assert tempo == w16 + 2 * n + 2 * n + 4 * rows


def test_gelu_and_layernorm_reference_against_plain_fp32_bf16():
    """The CPU path users run: module outputs and gradients against the non-Tempo ops."""
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = (torch.randn(4, 9, 32) * 2).to(dtype)
        for new, old in ((TempoGELU("tanh"), nn.GELU("tanh")),
                         (TempoLayerNorm(32).to(dtype), None)):
            ref = old if old is not None else copy.deepcopy(new)
            if old is None:
                ref.__class__ = nn.LayerNorm
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = new(a), ref(b)
            assert torch.allclose(ya.float(), yb.float(), rtol=tol, atol=tol)
            g = torch.randn_like(ya)
            (ga,), (gb,) = torch.autograd.grad(ya, a, g), torch.autograd.grad(yb, b, g)
            assert (ga.float() - gb.float()).abs().max() <= 4 * tol * gb.float().abs().max()


@pytest.mark.compile
def test_compiled_block_with_tempo_has_no_graph_break():
    """fullgraph=True: a graph break (or an unsupported op) in the Tempo modules would raise."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32),
                          nn.LayerNorm(32))
    tempo = apply_tempo_to_module(copy.deepcopy(block))
    assert isinstance(tempo[0], TempoLayerNorm) and isinstance(tempo[2], TempoGELU)
    compiled = torch.compile(tempo, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 8, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = compiled(x), block(x2)
    assert torch.allclose(out, ref, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *tempo.parameters()], g)
    exp = torch.autograd.grad(ref, [x2, *block.parameters()], g)
    for a, b in zip(got, exp):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    # One graph; which Tempo ops it holds on each compiled path: tests/test_tempo_compiled.py.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    torch.compile(tempo, fullgraph=True, backend=counter)(x)
    assert counter.frame_count == 1


@pytest.mark.compile
def test_compiled_hf_bert_layer_with_tempo():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  attn_implementation="sdpa")
    layer = transformers.models.bert.modeling_bert.BertLayer(cfg)
    tempo = apply_tempo_to_module(copy.deepcopy(layer))
    torch._dynamo.reset()
    compiled = torch.compile(tempo, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 6, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = compiled(x), layer(x2)
    out = out[0] if isinstance(out, tuple) else out
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(out, ref, atol=1e-5)
    (gx,), (gr,) = torch.autograd.grad(out.sum(), [x]), torch.autograd.grad(ref.sum(), [x2])
    assert torch.allclose(gx, gr, rtol=1e-4, atol=1e-5)


def _hf_layer(kind: str, dropout: float):
    transformers = pytest.importorskip("transformers")
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                      hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout,
                                      attn_implementation="eager")
        return transformers.models.bert.modeling_bert.BertLayer(cfg).train(), {}
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, resid_pdrop=dropout, attn_pdrop=dropout,
                                  embd_pdrop=dropout, activation_function="gelu_new",
                                  attn_implementation="eager")
    return transformers.models.gpt2.modeling_gpt2.GPT2Block(cfg, layer_idx=0).train(), {}


def _saved(m, x, kw):
    def fn(t):
        out = m(t * 1.0, **kw)  # t * 1.0: the first LayerNorm's input is not the leaf
        return out[0] if isinstance(out, tuple) else out
    return saved_bytes(fn, x, exclude=[x, m])


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_layer_saved_bytes_drop_by_the_analytic_amount(kind):
    """slapo.profile's saved-for-backward bytes of one layer, fp32 on CPU (b=2, s=16, h=64, 4
    heads, FFN 256): the GELU input and the LayerNorm inputs are no longer saved, and with dropout
    the attention keeps a bool mask instead of a float mask plus the dropout output.

    Per layer Tempo removes: the GELU's saved input (BERT's erf GELU: 4 B/el; HF GPT-2's Python
    tanh formula saves four FFN-sized tensors, 16 B/el) minus the 1-byte code; per LayerNorm the
    fp32 mean and the fp32 input, since the output it keeps instead is shared with the next
    Linear -- except BERT's last LayerNorm, whose output is the layer output (shared with the next
    layer's QKV only in a stack, so within one layer it swaps x for y); with dropout p > 0, per
    attention-score element the CPU float mask and the dropout output (4 + 4 B) minus a bool mask.
    """
    b, s, h, heads, ffn = 2, 16, 64, 4, 256
    n_ffn, rows, n_bsh, n_att = b * s * ffn, b * s, b * s * h, b * heads * s * s
    gelu = (4 if kind == "bert" else 16) * n_ffn - n_ffn
    ln = 2 * 4 * rows + (1 if kind == "bert" else 2) * 4 * n_bsh
    x = torch.randn(b, s, h, requires_grad=True)
    drops = {}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        layer, kw = _hf_layer(kind, dropout)
        base = _saved(layer, x, kw)
        no_att = apply_tempo_to_module(copy.deepcopy(layer), attention=False)
        assert base - _saved(no_att, x, kw) == gelu + ln
        drops[dropout] = base - _saved(apply_tempo_to_module(copy.deepcopy(layer)), x, kw)
    # Tempo's attention core: with dropout it saves the float mask and the dropout output.
    assert drops[0.1] - drops[0.0] == (4 + 4 - 1) * n_att
    if kind == "bert":
        assert drops[0.0] == gelu + ln
