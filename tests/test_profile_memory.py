"""slapo.profile: exact byte counts that later memory claims rely on."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slapo.profile import LiveTensorBytes, memory_breakdown, memory_timeline, saved_bytes

B, H = 64, 1024
F32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H))


class Ckpt(nn.Module):
    """Non-reentrant activation checkpoint around `inner`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU())


def test_mlp_adam_exact_bytes():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(B, H)
    r = memory_breakdown(model, (x,), optimizer=opt)
    n_params = sum(p.numel() for p in model.parameters())
    assert r.weights == n_params * F32
    assert r.grads == n_params * F32
    # Adam: exp_avg + exp_avg_sq per parameter, plus one fp32 scalar `step` per parameter tensor.
    assert r.optimizer_state == 2 * n_params * F32 + F32 * len(list(model.parameters()))
    # Saved: the input x (by Linear 0) and the ReLU output (by ReLU and Linear 2: one storage).
    assert r.activations == 2 * B * H * F32
    assert r.per_module["0"]["activations"] == B * H * F32
    assert r.per_module["1"]["activations"] == B * H * F32
    assert "activations" not in r.per_module["2"]
    assert r.per_module["0"]["weights"] == (H * H + H) * F32
    assert r.total == r.weights + r.grads + r.optimizer_state + r.activations
    # Live after forward: relu(h), the output and the loss scalar (x predates the step; h = the
    # first Linear's output is freed because ReLU saves its output, not its input).
    assert r.live_after_forward == 2 * B * H * F32 + F32
    assert r.peak_live >= r.live_after_forward


def test_checkpoint_cuts_block_to_its_input():
    torch.manual_seed(0)
    x = torch.randn(B, H)
    plain = nn.Sequential(nn.Linear(H, H), block(), nn.Linear(H, H))
    ckpt = nn.Sequential(nn.Linear(H, H), Ckpt(block()), nn.Linear(H, H))
    ckpt.load_state_dict(
        {
            k.replace("1.", "1.inner.", 1) if k.startswith("1.") else k: v
            for k, v in plain.state_dict().items()
        }
    )
    rp = memory_breakdown(plain, (x,))
    rc = memory_breakdown(ckpt, (x,))
    act = B * H * F32
    # Plain block: its input (saved by its first Linear) and both ReLU outputs.
    assert rp.module_bytes("1") == 3 * act
    # Checkpointed block: only the input it stashes for recomputation.
    assert rc.module_bytes("1") == act
    # The block output is still needed: now the last Linear is the one saving it.
    assert rc.module_bytes("2") == act and rp.module_bytes("2") == 0
    assert rp.activations == 4 * act and rc.activations == 3 * act
    # And the gradients are unchanged.
    assert torch.allclose(plain[1][0].weight.grad, ckpt[1].inner[0].weight.grad, atol=1e-6)


def test_saved_bytes_and_params_excluded():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    # Linear saves its input only (the weight is a parameter).
    assert saved_bytes(lin, x) == 4 * 16 * F32
    assert saved_bytes(lin, x, exclude=[x]) == 0
    # sigmoid saves its output; a view of the same storage is counted once.
    y = torch.randn(10, 10, requires_grad=True)
    assert saved_bytes(lambda t: torch.sigmoid(t).view(100).sigmoid(), y) == 2 * 100 * F32
    # Two sigmoid outputs; the product saves both again (same storages, so no extra bytes).
    assert saved_bytes(lambda t: torch.sigmoid(t) * torch.sigmoid(t), y) == 2 * 100 * F32
    # exp saves its output, and a product with a fresh tensor saves that tensor too.
    assert saved_bytes(lambda t: torch.exp(t) * torch.cos(t), y) == 3 * 100 * F32


def test_freed_branch_not_counted():
    y = torch.randn(1000, requires_grad=True)

    def fn(t):
        _unused = torch.exp(t)  # saves its output, then the graph is dropped
        del _unused
        return t * 2.0

    assert saved_bytes(fn, y) == 0


def test_live_tensor_bytes_inplace_not_counted():
    x = torch.zeros(256)
    with LiveTensorBytes() as live:
        x.add_(1.0)
        y = x * 2
        assert live.current == 256 * F32
        del y
    assert live.current == 0
    assert live.peak == 256 * F32


def test_outputs_table_json_plot(tmp_path):
    r = memory_breakdown(mlp(), torch.randn(8, H), loss_fn=lambda out: out.pow(2).mean())
    d = json.loads(r.to_json(tmp_path / "m.json"))
    assert d["activations"] == r.activations and d["total"] == r.total
    assert json.loads((tmp_path / "m.json").read_text())["weights"] == r.weights
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(r.table())
    text = console.export_text()
    assert "activations" in text and "total" in text
    pytest.importorskip("matplotlib")
    png = r.plot(tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_output_raises():
    class NoTensor(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return {"ids": [1, 2]}

    with pytest.raises(ValueError, match="loss_fn"):
        memory_breakdown(NoTensor(), torch.randn(1, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_reported():
    model = mlp().cuda()
    r = memory_breakdown(model, torch.randn(B, H, device="cuda"))
    assert r.cuda_peak_allocated is not None and r.cuda_peak_allocated >= r.weights + r.activations


def test_profiler_timeline_categories():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    opt = torch.optim.Adam(model.parameters())
    n_bytes = sum(p.numel() for p in model.parameters()) * F32
    r = memory_timeline(model, torch.randn(16, 128), optimizer=opt)
    assert r["final"]["parameter"] == n_bytes
    assert r["final"]["gradient"] == n_bytes
    assert r["final"]["optimizer_state"] == 2 * n_bytes + 4 * F32  # + the 4 `step` scalars
    assert r["peak_total"] == sum(r["at_peak"].values()) >= 4 * n_bytes


def test_hf_model_dict_inputs_and_tied_weights():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    ids = torch.randint(0, 64, (2, 8))
    opt = torch.optim.AdamW(model.parameters())
    r = memory_breakdown(model, {"input_ids": ids, "labels": ids}, optimizer=opt)
    unique = {p.data_ptr(): p.numel() * F32 for p in model.parameters()}
    assert r.weights == sum(unique.values())  # the tied matrix counts once
    assert r.grads == r.weights
    assert r.activations > 0 and r.module_bytes("transformer.h.0") > 0
    assert r.module_bytes("") == r.activations
