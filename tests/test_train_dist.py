"""`slapo train` on 2 gloo ranks: data and tensor parallelism, sharded checkpoints, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, seq_len=32, batch_size=8, steps=6,
            progress=False, plot=False, eval_batches=0, dropout=0.1, lr=1e-2)


def job_train(options: dict) -> dict:
    """Runs on every rank of the pool (process group already initialised)."""
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    m = train(TrainConfig(**options))
    return {"losses": m["losses"], "schedule": m["schedule"], "world": m["world_size"],
            "params": m["parameters_on_rank0"]}


def _single(options: dict) -> list[float]:
    return job_train(options)["losses"]


def _train_save_resume(dist2, tmp_path: Path, **knobs) -> tuple[list[dict], list[dict]]:
    straight = dist2.run(job_train, {**TINY, **knobs, "out": str(tmp_path / "a"),
                                     "save_every": 3})
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    resumed = dist2.run(job_train, {**TINY, **knobs, "out": str(tmp_path / "b"),
                                    "resume": str(step3)})
    return straight, resumed


@pytest.mark.dist
def test_data_parallel_trains_like_one_process_and_resumes_exactly(dist2, tmp_path):
    straight, resumed = _train_save_resume(dist2, tmp_path)
    assert straight[0]["world"] == 2
    assert straight[0]["losses"] == straight[1]["losses"]  # the loss is reduced over dp ranks
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    single = _single({**TINY, "dropout": 0.0})
    dp = dist2.run(job_train, {**TINY, "dropout": 0.0})[0]["losses"]
    # The same global batch and gradient (a mean over two halves), in another summation order.
    assert dp == pytest.approx(single, rel=1e-5, abs=1e-6)


def _need_model_schedule() -> None:
    import slapo.model_schedule as model_schedule

    if not hasattr(model_schedule, "apply"):
        pytest.skip("slapo.model_schedule.apply is not available")


@pytest.mark.dist
def test_tensor_parallel_sharded_checkpoint_resumes_exactly(dist2, tmp_path):
    _need_model_schedule()
    import torch.distributed.checkpoint as dcp

    straight, resumed = _train_save_resume(dist2, tmp_path, tp=2, attention="sdpa")
    assert straight[0]["schedule"].startswith("applied"), straight[0]["schedule"]
    unsharded = job_train({**TINY, "steps": 1})["params"]
    assert straight[0]["params"] < 0.8 * unsharded  # each rank holds shards
    assert straight[0]["losses"] == straight[1]["losses"]
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    # Each rank saved its own shard: the checkpoint holds the full (HF-shaped) tensors.
    meta = dcp.FileSystemReader(str(tmp_path / "a" / "checkpoints" / "step_000003"))
    sizes = {k: tuple(v.size) for k, v in meta.read_metadata().state_dict_metadata.items()
             if hasattr(v, "size")}
    assert sizes["model.transformer.h.0.mlp.c_fc.weight"] == (64, 256)
    assert sizes["optim.state.transformer.h.0.mlp.c_fc.weight.exp_avg"] == (64, 256)
    # fused q|k|v, sharded per block, is stored with its axis split into (blocks, rest)
    assert sizes["model.transformer.h.0.attn.c_attn.weight"] == (64, 3, 64)


@pytest.mark.dist
def test_pipeline_two_stages_resumes_exactly(dist2, tmp_path):
    """--pp-stages 2: each rank saves only its stage's parameters; resuming restores both."""
    _need_model_schedule()
    straight, resumed = _train_save_resume(dist2, tmp_path, pp_stages=2, dropout=0.0)
    assert straight[0]["schedule"] == "applied: pp_stages=2"
    assert straight[0]["losses"] == straight[1]["losses"]
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    single = _single({**TINY, "dropout": 0.0})
    assert straight[0]["losses"] == pytest.approx(single, rel=1e-5)


@pytest.mark.dist
def test_dp_shard_fsdp2_trains_like_one_process_and_resumes_exactly(dist2, tmp_path):
    """--dp-shard: FSDP2 over the 2 data-parallel ranks; its sharded checkpoint resumes."""
    straight, resumed = _train_save_resume(dist2, tmp_path, dp_shard=True)
    assert straight[0]["losses"] == straight[1]["losses"]
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    single = _single({**TINY, "dropout": 0.0})
    fsdp = dist2.run(job_train, {**TINY, "dropout": 0.0, "dp_shard": True})[0]
    assert fsdp["params"] < 0.6 * job_train({**TINY, "steps": 1})["params"]  # sharded
    assert fsdp["losses"] == pytest.approx(single, rel=1e-5, abs=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["GPipe", "Interleaved1F1B"])
def test_pp_schedule_matches_one_process(dist2, name):
    """--pp-schedule: GPipe (one stage per rank), Interleaved1F1B (the model cut into 4)."""
    _need_model_schedule()
    opts = {**TINY, "dropout": 0.0, "num_layers": 4}
    ranks = dist2.run(job_train, {**opts, "pp_stages": 2, "pp_schedule": name})
    cut = 4 if name == "Interleaved1F1B" else 2
    assert ranks[0]["schedule"] == f"applied: pp_stages={cut}"
    assert ranks[0]["losses"] == pytest.approx(_single(opts), rel=1e-5)


def job_schedule_facts(options: dict) -> dict:
    """Losses plus what the schedule did to the model on this rank (process group is up)."""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import train
    from slapo.train.setup import setup, teardown

    torch.set_num_threads(1)
    cfg = TrainConfig(**options)
    cfg.check()
    env = setup(cfg)
    try:
        model = build(cfg, env, log=lambda *a: None).model
        wte = model.transformer.wte.weight.shape
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    finally:
        teardown(env)
    m = train(TrainConfig(**options))
    return {"losses": m["losses"], "schedule": m["schedule"], "wte": tuple(wte),
            "hooks": hooks, "dims": m["parallel_dims"]}


@pytest.mark.dist
def test_sequence_and_vocab_parallel_flags_shard_on_two_ranks(dist2):
    """`--tp 2 --sequence-parallel` and `--no-vocab-parallel` reach `apply` from `slapo train`:
    SP adds the sequence split/gather hooks and trains to the same losses as TP alone; without
    vocabulary parallelism the embedding stays whole (it is split over the vocabulary with it)."""
    _need_model_schedule()
    opts = {**TINY, "dropout": 0.0, "steps": 3, "tp": 2}
    tp = dist2.run(job_schedule_facts, opts)[0]
    sp = dist2.run(job_schedule_facts, {**opts, "sequence_parallel": True})[0]
    whole = dist2.run(job_schedule_facts, {**opts, "vocab_parallel": False})[0]
    assert tp["dims"] == "dp=1 x pp=1 x tp=2"
    assert sp["schedule"] == "applied: tp=2, sequence_parallel=True"
    assert sp["hooks"] > tp["hooks"]  # the sequence split / gather around the layers
    assert sp["losses"] == pytest.approx(tp["losses"], rel=1e-5, abs=1e-6)
    assert whole["schedule"] == "applied: tp=2, vocab_parallel=False"
    assert whole["wte"][0] == 2 * tp["wte"][0]  # vocab-parallel: each rank holds half the rows
    assert whole["losses"] == pytest.approx(tp["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.dist
def test_tp_inside_fsdp2_trains_like_tp_with_ddp_and_resumes_exactly(dist4, tmp_path):
    """--tp 2 --dp-shard on 4 ranks (dp=2 x tp=2): FSDP2 shards the TP shards. Same losses as
    TP with DDP (same dropout streams); the checkpoint resumes bit for bit; it holds each
    tensor whole, as a reshape of the HF shape (see slapo.train.shard_layout)."""
    _need_model_schedule()
    import torch.distributed.checkpoint as dcp

    knobs = {**TINY, "tp": 2, "attention": "sdpa"}
    straight = dist4.run(job_train, {**knobs, "dp_shard": True, "out": str(tmp_path / "a"),
                                     "save_every": 3})
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    resumed = dist4.run(job_train, {**knobs, "dp_shard": True, "out": str(tmp_path / "b"),
                                    "resume": str(step3)})
    ddp = dist4.run(job_train, knobs)
    assert all(r["losses"] == straight[0]["losses"] for r in straight)
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    assert straight[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5)
    assert straight[0]["params"] < 0.6 * ddp[0]["params"]  # FSDP2 halves each TP shard
    meta = dcp.FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    for key, shape in {"transformer.h.0.mlp.c_fc.weight": (64, 256),  # FSDP rows, TP columns
                       "transformer.h.0.mlp.c_proj.weight": (2, 128, 64),  # both on rows
                       "transformer.h.0.attn.c_attn.weight": (64, 3, 64),  # fused q|k|v
                       "transformer.h.0.attn.c_attn.bias": (3, 64)}.items():  # gathered
        assert tuple(meta[f"model.{key}"].size) == shape, key
        assert tuple(meta[f"optim.state.{key}.exp_avg"].size) == shape, key


def job_refused(options: dict) -> str:
    from slapo.train import TrainConfig, train

    try:
        train(TrainConfig(**options))
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.dist
def test_pipeline_with_fsdp2_trains_like_one_process_and_resumes_exactly(dist4, tmp_path):
    """--pp-stages 2 --dp-shard on 4 ranks (dp=2 x pp=2): each stage FSDP2-sharded over its 2
    data-parallel ranks. Losses equal one process's; the checkpoint (each stage's dp shards,
    optimizer hyper-parameters keyed by parameter name) resumes bit for bit. Without
    --dp-shard the job is refused before anything is built (DDP cannot hold a stage)."""
    _need_model_schedule()
    knobs = {**TINY, "pp_stages": 2, "dropout": 0.0, "dp_shard": True}
    straight = dist4.run(job_train, {**knobs, "out": str(tmp_path / "a"), "save_every": 3})
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    resumed = dist4.run(job_train, {**knobs, "out": str(tmp_path / "b"), "resume": str(step3)})
    assert all(r["losses"] == straight[0]["losses"] for r in straight)
    assert resumed[0]["losses"][3:] == straight[0]["losses"][3:]
    assert straight[0]["losses"] == pytest.approx(_single({**TINY, "dropout": 0.0}), rel=1e-5,
                                                  abs=1e-6)
    refused = dist4.run(job_refused, {**knobs, "dp_shard": False})
    assert all("DDP cannot hold a pipeline stage: add --dp-shard" in r for r in refused), refused


# ---- resuming on another layout -----------------------------------------------------------------
ONE, DDP2, FSDP2 = (1, {}), (2, {}), (2, {"dp_shard": True})
TP2, PP2, TP2_FSDP2 = (2, {"tp": 2}), (2, {"pp_stages": 2}), (4, {"tp": 2, "dp_shard": True})
RESHARDED = {
    "ddp2_to_one": (DDP2, ONE), "one_to_ddp2": (ONE, DDP2),
    "fsdp2_to_one": (FSDP2, ONE), "one_to_fsdp2": (ONE, FSDP2),
    "ddp2_to_fsdp2": (DDP2, FSDP2),  # the same count: DDP's replicas into FSDP2 shards
    "pp2_fsdp2_to_pp2": ((4, {"pp_stages": 2, "dp_shard": True}), PP2),
    "tp2_ddp2_to_tp2": ((4, {"tp": 2}), TP2),
    "tp2_to_one": (TP2, ONE), "one_to_tp2": (ONE, TP2), "tp2_to_pp2": (TP2, PP2),
    "pp2_to_tp2_fsdp2": (PP2, TP2_FSDP2), "tp2_fsdp2_to_tp2": (TP2_FSDP2, TP2),
    "tp2_fsdp2_to_one": (TP2_FSDP2, ONE), "tp2_to_tp2_sp_whole_vocab":
        (TP2, (2, {"tp": 2, "sequence_parallel": True, "vocab_parallel": False})),
}


def _on(n: int, pools: dict, fn, options: dict) -> list:
    return [fn(options)] if n == 1 else pools[n].run(fn, options)


def job_resumed(options: dict) -> dict:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    m = train(TrainConfig(**options))
    return {"losses": m["losses"], "world": m["world_size"]}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(RESHARDED))
def test_resume_on_another_layout_continues_the_run(dist2, dist4, tmp_path, case):
    """A checkpoint resumes on another number of processes or parallel layout (a lost node,
    another allocation, another --tp): weights, optimizer state, step and data position are
    the run's (dropout off: the losses continue the uninterrupted run's to roundoff), each
    tensor read into this job's layout, GPT-2's fused q|k|v across its reshapes too; the RNG
    streams restart from the seed and the step."""
    pools = {2: dist2, 4: dist4}
    (n_a, a), (n_b, b) = RESHARDED[case]
    opts = {**TINY, "dropout": 0.0}
    straight = _on(n_a, pools, job_resumed, {**opts, **a, "out": str(tmp_path / "a"),
                                             "save_every": 3})[0]
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    resumed = _on(n_b, pools, job_resumed, {**opts, **b, "out": str(tmp_path / "b"),
                                            "resume": str(step3)})
    assert all(r["losses"] == resumed[0]["losses"] for r in resumed)
    assert resumed[0]["world"] == n_b and straight["world"] == n_a
    assert resumed[0]["losses"][:3] == straight["losses"][:3]  # the history, as saved
    assert resumed[0]["losses"][3:] == pytest.approx(straight["losses"][3:], rel=1e-5, abs=1e-6)
