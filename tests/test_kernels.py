"""The Triton kernels of `slapo.op.kernels`, run on CPU by Triton's interpreter, against the
PyTorch reference path: outputs and gradients, fp32 and bf16, sizes that are not multiples of
the block size, rows split over several chunks and several rows per backward program.

Why the tolerances: fp32 agrees to fp32 roundoff. In bf16 both sides round to bf16 at the same
points, but Triton 3.x's interpreter converts fp32 -> bf16 by truncation (the GPU rounds to
nearest even), so a few results land one bf16 ulp apart; `assert_match` allows 2 ulps of the
value plus a small fraction of the tensor's range (for sums over rows).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_for_this_device():
    """The triton module; on CPU one whose kernels *and library* (tl.sum, tl.rand, ...) run in
    the interpreter.

    Triton decides at decoration time whether a function is compiled or interpreted, and test
    collection may already have imported it in compiled mode (`import torch._dynamo` imports
    triton). Then its pure-Python modules (not the `triton._C` extension, which cannot be loaded
    twice) and our kernel modules are dropped from `sys.modules` and imported again with
    `TRITON_INTERPRET=1`. CPU only: nothing in a CPU process runs compiled Triton code.
    """
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    mod = pytest.importorskip(
        "triton", reason="the triton package is not installed (pip install -e '.[dev]'); the "
        "Triton kernels cannot be interpreted on CPU without it")
    if DEVICE == "cuda" or _interpreted(mod):
        return mod
    for name in [m for m in sys.modules if _compiled_mode_module(m)]:
        del sys.modules[name]
    return importlib.import_module("triton")


def _compiled_mode_module(name: str) -> bool:
    if name.startswith("slapo.op.kernels._") and name.endswith("_triton"):
        return True
    return (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")


def _interpreted(mod) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(mod.language.standard.sum, InterpretedFunction)


triton = _triton_for_this_device()

from slapo.op import kernels as K  # noqa: E402
from slapo.op.kernels import _common  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32

pytestmark = [
    pytest.mark.skipif(DEVICE == "cpu" and not _interpreted(triton), reason="triton could not "
                       "be re-imported in interpreter mode; run this file in its own process"),
    # numpy's exp overflows to inf in the interpreter's sigmoid for large |x|; the result is exact
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


def assert_match(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = F32) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.float(), expected.float()
    scale = e.abs().max().item()
    if dtype == BF16:
        tol = 2 ** -6 * e.abs() + 2 ** -8 * scale
    else:
        tol = 1e-5 * e.abs() + 1e-6 * max(scale, 1.0)
    bad = (a - e).abs() > tol
    assert not bad.any(), (f"{bad.sum().item()} of {a.numel()} differ; max |diff| "
                           f"{(a - e).abs().max().item():.3g}, max |expected| {scale:.3g}")


def grads(out, inputs, seed=1):
    """Gradients of `out` (a tensor or tuple) w.r.t. `inputs` for a fixed random cotangent."""
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    return torch.autograd.grad(outs, inputs, cots)


def leaf(*shape, dtype=F32, scale=1.0, shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = shift + scale * torch.randn(*shape, generator=gen)
    return x.to(DEVICE, dtype).requires_grad_()


NORM_DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32)]  # (input, weight): bf16 + fp32 master


RMS_REFERENCE = {"llama": K.rms_norm_reference, "t5": K.t5_rms_norm_reference}


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunked_rows"])
@pytest.mark.parametrize("dtypes", NORM_DTYPES + [(F32, BF16)],
                         ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("style", ["llama", "t5"])
def test_rms_norm(style, dtypes, chunked, monkeypatch):
    """Both styles round where their HF module does: the T5 style keeps a bf16 input's
    normalised value in fp32 under an fp32 weight (output fp32), and rounds it to the weight's
    dtype under a bf16 one, even for an fp32 input."""
    if chunked:  # 37 columns in chunks of 16: 3 chunks, the last one partial
        monkeypatch.setattr(_common, "MAX_ROW_BLOCK", 16)
    xd, wd = dtypes
    x = leaf(2, 7, 37, dtype=xd, scale=2.0)  # 14 rows: 4 backward programs of <= 4 rows
    w = leaf(37, dtype=wd, scale=0.1, shift=1.0, seed=1)
    y = K.rms_norm(x, w, 1e-6, backend="triton", style=style)
    ref = RMS_REFERENCE[style](x, w, 1e-6)
    tol = BF16 if BF16 in dtypes else F32
    assert_match(y, ref, tol)
    for got, want in zip(grads(y, (x, w)), grads(ref, (x, w))):
        assert_match(got, want, tol)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunked_rows"])
@pytest.mark.parametrize("dtypes", NORM_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.",
                                                                                        ""))
def test_layer_norm(dtypes, chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(_common, "MAX_ROW_BLOCK", 16)
    xd, wd = dtypes
    x = leaf(2, 7, 37, dtype=xd, scale=2.0, shift=0.5)
    w = leaf(37, dtype=wd, scale=0.1, shift=1.0, seed=1)
    b = leaf(37, dtype=wd, scale=0.1, seed=2)
    y = K.layer_norm(x, w, b, 1e-5, backend="triton")
    ref = F.layer_norm(x, (37,), w, b, 1e-5)
    assert_match(y, ref, xd)
    for got, want in zip(grads(y, (x, w, b)), grads(ref, (x, w, b))):
        assert_match(got, want, xd)


@pytest.mark.parametrize("affine", ["weight_only", "none"])
def test_layer_norm_without_bias_or_weight(affine):
    x = leaf(5, 19, scale=3.0)
    w = leaf(19, shift=1.0, seed=1) if affine == "weight_only" else None
    y = K.layer_norm(x, w, None, 1e-5, backend="triton")
    ref = F.layer_norm(x, (19,), w, None, 1e-5)
    assert_match(y, ref)
    inputs = (x, w) if w is not None else (x,)
    for got, want in zip(grads(y, inputs), grads(ref, inputs)):
        assert_match(got, want)


def test_layer_norm_fp32_output_as_cuda_autocast():
    """CUDA autocast runs layer_norm in fp32: the kernel reads bf16 x and writes fp32 directly."""
    x = leaf(6, 21, dtype=BF16, scale=2.0)
    w, b = leaf(21, shift=1.0, seed=1), leaf(21, seed=2)
    y = K.LayerNormFunction.apply(x, w, b, 1e-5, True)
    ref = F.layer_norm(x.float(), (21,), w, b, 1e-5)
    assert y.dtype == F32
    assert_match(y, ref)
    for got, want in zip(grads(y, (x, w, b)), grads(ref, (x, w, b))):
        assert_match(got, want, BF16 if got.dtype == BF16 else F32)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_swiglu(dtype, monkeypatch):
    monkeypatch.setattr(_common, "ELEMENTWISE_BLOCK", 16)  # 45 columns: 3 blocks, last partial
    gate_up = leaf(3, 5, 90, dtype=dtype, scale=2.0)
    gate, up = gate_up.split(45, dim=-1)  # strided views, as a fused gate_up projection gives
    y = K.swiglu(gate, up, backend="triton")
    ref = K.swiglu_reference(gate, up)
    assert_match(y, ref, dtype)
    assert_match(grads(y, gate_up)[0], grads(ref, gate_up)[0], dtype)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_bias_gelu(dtype, approximate, bias, monkeypatch):
    monkeypatch.setattr(_common, "ELEMENTWISE_BLOCK", 16)
    x = leaf(3, 5, 45, dtype=dtype, scale=2.0)  # 15 rows over 4 programs, 3 column blocks
    b = leaf(45, dtype=dtype, seed=1) if bias else None
    y = K.bias_gelu_dropout(x, b, approximate, backend="triton")
    ref = K.bias_gelu_dropout_reference(x, b, approximate)
    assert_match(y, ref, dtype)
    inputs = (x, b) if bias else (x,)
    for got, want in zip(grads(y, inputs), grads(ref, inputs)):
        assert_match(got, want, dtype)


def test_gelu_matches_hf_new_gelu():
    """The tanh form is HF's `NewGELUActivation` (GPT-2's "gelu_new"), written out in fp32."""
    act = pytest.importorskip("transformers.activations").NewGELUActivation()
    x = leaf(4, 33, scale=3.0)
    y = K.FusedGELU("tanh", backend="triton")(x)
    ref = act(x)
    assert_match(y, ref)
    assert_match(grads(y, x)[0], grads(ref, x)[0])


def test_bias_gelu_dropout_mask_is_regenerated_in_backward(monkeypatch):
    """Forward and backward draw the same Philox mask from the saved seed: the gradient is the
    reference's through exactly the mask the forward applied."""
    monkeypatch.setattr(_common, "ELEMENTWISE_BLOCK", 32)
    p = 0.3
    x = leaf(8, 70, scale=2.0)
    b = leaf(70, seed=1)
    torch.manual_seed(123)
    y = K.bias_gelu_dropout(x, b, "none", p=p, training=True, backend="triton")
    keep = y.detach() != 0  # gelu(x + b) is never exactly 0 for these inputs
    assert abs(keep.float().mean().item() - (1 - p)) < 0.06
    ref = F.gelu(x + b) * keep / (1 - p)
    assert_match(y, ref)
    for got, want in zip(grads(y, (x, b)), grads(ref, (x, b))):
        assert_match(got, want)
    torch.manual_seed(123)  # same generator state, same mask (checkpoint recomputation)
    again = K.bias_gelu_dropout(x, b, "none", p=p, training=True, backend="triton")
    assert torch.equal(again, y)
    other = K.bias_gelu_dropout(x, b, "none", p=p, training=True, backend="triton")
    assert not torch.equal(other != 0, keep)
    evaluated = K.bias_gelu_dropout(x, b, "none", p=p, training=False, backend="triton")
    assert_match(evaluated, F.gelu(x + b))


def rope_inputs(dtype, cos_dtype, bsz=2, hq=4, hk=2, seq=5, dim=12, cos_batch=None):
    """q as HF makes it: a [B, S, H, D] projection transposed to [B, H, S, D] (a strided view)."""
    q = leaf(bsz, seq, hq, dim, dtype=dtype).detach().transpose(1, 2).requires_grad_()
    k = leaf(bsz, seq, hk, dim, dtype=dtype, seed=1).detach().transpose(1, 2).requires_grad_()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=F32) / dim))
    pos = torch.arange(seq, dtype=F32)[None].expand(cos_batch or bsz, seq) + 3
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)  # LlamaRotaryEmbedding's layout
    return q, k, emb.cos().to(DEVICE, cos_dtype), emb.sin().to(DEVICE, cos_dtype)


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)],
                         ids=["fp32", "bf16", "bf16_q_fp32_cos"])
def test_rope(dtypes):
    q, k, cos, sin = rope_inputs(*dtypes)
    out = K.apply_rotary_pos_emb(q, k, cos, sin, backend="triton")
    ref = K.rope_reference(q, k, cos, sin)
    for got, want in zip(out, ref):
        assert_match(got, want, dtypes[0])
    for got, want in zip(grads(out, (q, k)), grads(ref, (q, k))):
        assert_match(got, want, dtypes[0])


def test_rope_bshd_layout_and_broadcast_positions():
    """unsqueeze_dim=2 ([B, S, H, D] q/k) and cos/sin shared by the batch ([1, S, D])."""
    q, k, cos, sin = rope_inputs(F32, F32, bsz=3, cos_batch=1)
    q = q.detach().transpose(1, 2).requires_grad_()
    k = k.detach().transpose(1, 2).requires_grad_()
    out = K.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2, backend="triton")
    ref = K.rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    for got, want in zip(out, ref):
        assert_match(got, want)
    for got, want in zip(grads(out, (q, k)), grads(ref, (q, k))):
        assert_match(got, want)


def test_fused_llama_mlp_triton_matches_hf():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4)
    torch.manual_seed(0)
    mlp = tf.models.llama.modeling_llama.LlamaMLP(cfg).to(DEVICE)
    fused = K.FusedLlamaMLP(mlp, backend="triton")
    assert fused.gate_proj is mlp.gate_proj and fused.down_proj is mlp.down_proj
    assert list(fused.state_dict()) == list(mlp.state_dict())
    x = leaf(2, 3, 24)
    y, ref = fused(x), mlp(x)
    assert_match(y, ref)
    params = [x, *mlp.parameters()]
    for got, want in zip(grads(y, params), grads(ref, params)):
        assert_match(got, want)


def _kernel_cases() -> dict:
    """test_model_schedule_kernels' cases (every family of the kernel plans; needs transformers)."""
    try:
        import test_model_schedule_kernels as cases
    except pytest.skip.Exception:
        return {}
    return cases.CASES


@pytest.mark.parametrize("name", list(_kernel_cases()))
def test_scheduled_hf_model_on_the_triton_path(name):
    """`apply_kernels(..., backend="triton")` on a real tiny model of every family the kernel
    plans name (LLaMA, GPT-2, GPT-Neo, BERT, RoBERTa, ALBERT's shared layer, OPT, T5 v1.1, T5
    v1.0 and mT5): loss and every gradient match the unscheduled model (the Triton kernels
    inside HF's blocks, with HF's strides and shapes)."""
    import copy

    import slapo
    from slapo.model_schedule.kernels import apply_kernels

    factory, family, expected, _ = _kernel_cases()[name]
    torch.manual_seed(0)
    model = factory().to(DEVICE)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    assert apply_kernels(sch, family, backend="triton") == expected
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    losses, all_grads = [], []
    for m in (sch.mod, ref):
        loss = m(input_ids=ids, labels=ids).loss
        losses.append(loss)
        all_grads.append(torch.autograd.grad(loss, list(m.parameters())))
    assert_match(*losses)
    for got, want in zip(*all_grads, strict=True):
        assert_match(got, want)


@pytest.mark.compile
def test_compiled_graph_keeps_the_kernels_without_breaks():
    """`torch.compile(fullgraph=True)` traces through the autograd Functions: each Triton launch is
    one custom-op node (`torch.ops.slapo_kernels.*`, fake impls give the shapes), no break."""
    x = leaf(3, 5, 16)
    w, b = leaf(16, shift=1.0, seed=1), leaf(16, seed=2)
    q, k, cos, sin = rope_inputs(F32, F32, hq=2, hk=2, seq=5, dim=16)

    def block(x, w, b, q, k):
        h = K.rms_norm(x, w, 1e-6, backend="triton")
        h = K.layer_norm(h, w, b, 1e-5, backend="triton")
        h = K.swiglu(h, K.bias_gelu_dropout(h, b, "tanh", backend="triton"), backend="triton")
        qe, ke = K.apply_rotary_pos_emb(q, k, cos, sin, backend="triton")
        return h.sum() + qe.sum() + (ke * ke).sum()

    inputs = (x, w, b, q, k)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out, ref = compiled(*inputs), block(*inputs)
    assert_match(out, ref)
    for got, want in zip(torch.autograd.grad(out, inputs), torch.autograd.grad(ref, inputs)):
        assert_match(got, want)


def test_cpu_auto_backend_is_the_reference_exactly():  # CPU tensors on any machine
    """Without CUDA, "auto" runs the reference: bit-identical to the modules replaced."""
    tf = pytest.importorskip("transformers")
    norm = tf.models.llama.modeling_llama.LlamaRMSNorm(16, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 16, dtype=BF16)
    assert torch.equal(K.FusedRMSNorm.from_module(norm)(x), norm(x))
    ln = torch.nn.LayerNorm(16)
    assert torch.equal(K.FusedLayerNorm.from_module(ln)(x.float()), ln(x.float()))
    t5 = tf.models.t5.modeling_t5.T5LayerNorm(16, eps=1e-5)
    torch.nn.init.normal_(t5.weight)
    fused = K.FusedRMSNorm.from_module(t5, style="t5")
    assert fused(x).dtype == torch.float32  # bf16 input, fp32 weight: T5 keeps fp32
    assert torch.equal(fused(x), t5(x)) and not torch.equal(K.FusedRMSNorm.from_module(t5)(x),
                                                             t5(x))
    t5.weight.data = t5.weight.data.to(BF16)
    assert torch.equal(fused(x.float()), t5(x.float()))  # rounded to the bf16 weight's dtype


def test_backend_errors(monkeypatch):
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.rms_norm(x, torch.ones(8, dtype=torch.float64), backend="cuda")
    with pytest.raises(RuntimeError, match="supports"):
        K.rms_norm(x, torch.ones(8, dtype=torch.float64), backend="triton")
    with pytest.raises(ValueError, match="unknown RMSNorm style"):
        K.rms_norm(x, torch.ones(8, dtype=torch.float64), style="gemma")
    with pytest.raises(ValueError, match="does not match"):
        K.layer_norm(x.float(), torch.ones(4), None, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        K.swiglu(x.float(), x.float(), backend="triton")  # CPU tensors, no interpreter


def test_one_triton_policy_for_every_kernel(monkeypatch):
    """`SLAPO_TRITON` is the one switch of every Triton kernel's "auto" choice (the fused ops
    here and Tempo's): `0` runs the references, `1` also runs the kernels on CPU tensors under
    `TRITON_INTERPRET=1`; an explicit backend wins over it."""
    from slapo.op.kernels import _common

    monkeypatch.setattr(_common, "_TRITON_INSTALLED", True)  # the answer, not the install
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(4)
    monkeypatch.delenv(_common.ENV, raising=False)
    assert not _common.use_triton("auto", x)  # CPU tensors: the reference, as before
    monkeypatch.setenv(_common.ENV, "1")
    assert _common.use_triton("auto", x)
    assert not _common.use_triton("auto", x.double())  # no fp64 kernels: the reference
    assert not _common.use_triton("reference", x)
    monkeypatch.setenv(_common.ENV, "0")
    assert not _common.use_triton("auto", x)
    assert _common.use_triton("triton", x)  # forced: the variable does not override it
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(_common.ENV, "1")
    assert not _common.use_triton("auto", x)  # no interpreter: CPU tensors cannot run them
