"""A traced + fused GPT-2 MLP that is also tensor-parallel (2 gloo ranks), under Verify."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.compile]


def job_traced_fused_sharded_gpt2():
    import models
    import torch
    import torch.fx as fx
    from test_find import gpt2_bias_gelu

    import slapo

    model = models.gpt2(seed=0)
    keys = list(model.state_dict())
    sch = slapo.create_schedule(model)
    ids = models.ids()
    with slapo.Verify(sch, [ids], loss_fn=lambda out: out.loss,
                      example_kwargs={"labels": ids, "use_cache": False}) as v:
        mlp = sch["transformer.h.0.mlp"]
        mlp.trace(leaves=["c_fc", "c_proj"], flatten=True)
        mlp["c_fc"].decompose()
        mlp.fuse(mlp.find(gpt2_bias_gelu)[0], compiler="aot_eager", name="bias_gelu")
        # tensor parallel on the leaves of the traced graph (column then row parallel)
        mlp["c_fc"].shard("weight", axis=1)
        mlp["c_fc"].shard("bias", axis=0)
        mlp["c_fc"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        mlp["c_proj"].shard("weight", axis=0)
        mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["transformer.h.1"].checkpoint()  # a core primitive on another submodule
    ws = sch.world_size
    assert ws == 2
    assert isinstance(sch["transformer.h.0.mlp"].mod, fx.GraphModule)
    assert "bias_gelu" in sch["transformer.h.0.mlp"].child
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (64, 256 // ws)
    assert tuple(model.transformer.h[0].mlp.c_fc.bias.shape) == (256 // ws,)
    assert tuple(model.transformer.h[0].mlp.c_proj.weight.shape) == (256 // ws, 64)
    assert list(model.state_dict()) == keys
    report = v.report
    n_grads = sum(k.startswith("grad ") for k in report)
    assert n_grads == len(list(model.parameters())), (n_grads, len(list(model.parameters())))
    for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight"):
        assert any(name in k and k.startswith("grad ") for k in report), name
    assert max(report.values()) < 1e-4, max(report.values())
    # the scheduled model still trains
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    return losses


def test_traced_fused_mlp_with_tensor_parallel_under_verify(dist2):
    results = dist2.run(job_traced_fused_sharded_gpt2)
    assert results[0] == pytest.approx(results[1], rel=1e-6)  # ranks agree on the losses
