"""Progressive optimization: apply schedule steps one at a time and measure each.

This is Slapo's workflow in one function: start from the unmodified model, add one concern per
step (SDPA attention, fusion, Tempo layers, checkpointing, tensor parallelism; on GPU: compiled
blocks, kernels, a fused loss, selective checkpointing), and for every step report what it did
to speed (tokens/s, and the ratio to the baseline *in this run*), to memory (bytes saved for
backward by one forward) and to correctness (`Verify` against the baseline: outputs, every
gradient, one optimizer step).

**The trade, not only the cost.** A memory step (Tempo, checkpointing) is often slower at equal
batch: it recomputes what it did not save. What it buys is batch. So each step is also run at
the **largest batch that fits a fixed activation budget** — the baseline's saved-for-backward
bytes at the demo batch — and timed there:

* candidates are the demo batch times powers of two up to `budget_max_factor` (and halvings of
  it, for a step that needs more than the baseline); the search is capped so the demo stays short;
* the per-sample bytes measured at the demo batch predict the largest candidate; the bytes are
  then *measured* there (`slapo.profile.saved_bytes`, the same counter as the column before
  it), stepping down while a measurement exceeds the budget and up while one fits. A reported
  batch is a measured fit, and the next candidate was measured not to fit (or is past the cap);
* tokens/s at that batch is the fastest of a few AdamW steps (after one warm-up step on GPU,
  where a new batch shape recompiles compiled regions).

**One step loop.** Every variant trains through the `Trainer` that `slapo.build` makes
(`slapo.runtime.build.build_trainer`; AdamW; `precision="bf16"` on GPU is build's autocast,
fp32 master weights), timed by `slapo.runtime.step_timing.time_steps`: the step `slapo train`
runs.
Peak memory per row is `slapo.profile.meter`'s (`peak_bytes`, JSON only).

**Parallel dimensions.** `run(..., mesh=)` takes the job's ("dp", "pp", "tp") mesh
(`slapo.runtime.init_mesh`). Every schedule is made on the mesh's "tp" group, and only the TP
step shards, over that group (`tp=` its size; no TP step when it is 1). Data-parallel replicas
(dp > 1) run the same thing, each on the whole demo batch: a row describes one model replica
(the job trains dp times its tokens/s), and DDP's gradient all-reduce, the same for every step,
is left out of the comparison. Pipelines (pp > 1) are refused. Without a mesh the schedules use
the default process group (one process: no TP step). Each row records the degree its weights
were actually sharded (`shard_ways`, from the shard specs) and the parameters one rank holds.

Under torch.distributed every rank takes the same decisions (the measured bytes are all-reduced
with MAX), since a TP forward is a collective.

Used by `slapo train --progressive` (`slapo.train.demo`); callable directly for any supported
HF model. Layout: `steps` (the progressions and the row type), `progression` (`run`),
`measure` (one variant: bytes, timed steps, peak, budget batch), `budget` (the search's
bookkeeping), `report` (table, summary, JSON).
"""

from .budget import OVER, batch_candidates, largest_fitting, tiled_batches
from .progression import run
from .report import summary, table, to_json
from .steps import Step, StepResult, default_steps, gpu_steps

__all__ = ["OVER", "Step", "StepResult", "batch_candidates", "default_steps", "gpu_steps",
           "largest_fitting", "run", "summary", "table", "tiled_batches", "to_json"]
