"""A pipelined `slapo train --lora-r --pp-stages 2` run exported: each stage's checkpoint holds
its own layers' adapters under PEFT's names, and `slapo export --adapter` of the run (read in
one process) writes the adapter one process's run with `--grad-accum 2` (the pipeline's two
micro-batches) trains: the same 28 tensors, and the same loss when PEFT loads each onto the
base; `--merge` likewise."""

from __future__ import annotations

import pytest
import torch
from test_train_lora import LORA, save_base

pytest.importorskip("peft")

PROBE = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def job_train(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


def _loss(model) -> float:
    with torch.no_grad():
        return model.eval()(input_ids=PROBE, labels=PROBE).loss.item()


@pytest.mark.dist
def test_pipelined_lora_run_exports_what_one_process_trains(dist2, tmp_path):
    import peft
    import transformers
    from safetensors.torch import load_file

    from slapo.train import TrainConfig, train
    from slapo.train.export import export_run

    base = save_base(tmp_path / "base")
    opts = {**LORA, "model": base, "steps": 2, "save_every": 2, "progress": False}
    piped = dist2.run(job_train, {**opts, "pp_stages": 2, "out": str(tmp_path / "pp")})
    one = train(TrainConfig(**opts, grad_accum=2, out=str(tmp_path / "one")))["losses"]
    assert max(abs(a - b) / b for a, b in zip(piped[0], one)) < 1e-5, (piped, one)

    for run in ("pp", "one"):
        export_run(tmp_path / run, tmp_path / f"{run}_adapter", adapter=True,
                   log=lambda *a, **k: None)
        export_run(tmp_path / run, tmp_path / f"{run}_merged", merge=True,
                   log=lambda *a, **k: None)
    got = load_file(str(tmp_path / "pp_adapter" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "one_adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and len(got) == 28
    worst = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in got)
    assert worst < 1e-4, worst  # two AdamW steps on float32 sums in another order
    losses = {}
    for run in ("pp", "one"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        losses[run] = _loss(peft.PeftModel.from_pretrained(hf, str(tmp_path / f"{run}_adapter")))
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / f"{run}_merged"), local_files_only=True)
        assert _loss(merged) == pytest.approx(losses[run], rel=1e-5)
    assert losses["pp"] == pytest.approx(losses["one"], rel=1e-5)
