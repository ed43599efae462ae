"""Ready schedule for recurrent models: every `nn.LSTM` / `nn.GRU` becomes EcoRNN's fused twin.

    sch = apply_rnn(model, layout="hidden_major", ckpt_chunk=16)
    model = slapo.build(sch)  # or sch.mod

Not a HF family (recurrent models have no `config.model_type`): call it directly. Each RNN is
swapped by the `replace` primitive (so `sch.applied()` records one `replace(FusedLSTM(...))` per
module) for `slapo.op.rnn.FusedLSTM` / `FusedGRU` built by `from_module`, which keeps the *same*
Parameter objects and names: the state_dict, an optimizer built before the swap and tied weights
all stay valid. What the knobs do (fusion, layout, compiled cell, checkpointing over time
chunks) is documented in `slapo/op/rnn.py` and docs/rnn.md.

Decisions:
* Only exact `nn.LSTM` / `nn.GRU` instances are replaced; a subclass (whose forward may differ)
  is refused with an error naming it, since silently skipping it would leave the user thinking
  it was scheduled. `nn.RNN` (tanh/relu) is left alone.
* `fused=False` is the unscheduled baseline (a schedule with nothing applied, for benchmarks and
  the tuner); the other knobs need the fused module, so combining them with it is an error.
* Every value and every module is checked before the first `replace`, so an error leaves the
  model and the schedule unchanged.

Tensor parallelism (`tp=`, see docs/rnn.md "Tensor parallelism"): only the vocabulary-sized
layers are sharded, the recurrence stays replicated on every rank. Sharding an LSTM's gates over
`tp` ranks would split h_t, but every gate of step t+1 reads the *whole* h_t (W_hh @ h_t), so each
of the T time steps would need an all-gather of h on the critical path: T small latency-bound
collectives per layer and direction for a layer that is rarely the largest weight. The embedding
table (V x e) and the output projection (h x V) plus its (N, V) logits are, for a word-level LM,
the bulk of the parameters and of the FLOPs, and they shard with two collectives per step:
* every `nn.Embedding` whose output feeds an RNN (decided statically: its `embedding_dim` equals
  the `input_size` of an RNN of the model; pass `embeddings=` paths to choose) is sharded over
  the vocabulary (`shard("weight", axis=0)`: foreign ids give zero rows) and its output
  all-reduced (`sync(fwd_post, all_reduce)`);
* the output projection (`head=` path, else the one `nn.Linear` whose `out_features` equals a
  sharded embedding's vocabulary) becomes column-parallel over the vocabulary: weight (and bias)
  sharded on axis 0, its input gradient all-reduced (`sync(bwd_post, all_reduce)`, Megatron's f)
  and its logits all-gathered (`sync(fwd_post, all_gather, axis=-1)`). Gathering the logits was
  chosen over vocab-parallel cross-entropy because the loss is the user's code outside the model:
  the model's output stays exactly the unscheduled one, so any loss and `slapo.Verify` work
  unchanged (use `slapo.op.vocab_parallel.vocab_parallel_cross_entropy` on un-gathered logits
  yourself to save the gather). A head tied to the embedding is sharded once and stays tied.
"""

from __future__ import annotations

from torch import nn

from ..errors import SchedulingError
from ..op.rnn import FUSED
from ..op.rnn_kernels import LAYOUTS, check_knobs
from ..schedule import Schedule, create_schedule
from ..sharding import shard_spec

__all__ = ["LAYOUTS", "apply_rnn", "rnn_paths"]


def rnn_paths(model: nn.Module) -> list[str]:
    """Paths of the `nn.LSTM` / `nn.GRU` modules `apply_rnn` would replace, in model order."""
    return [name for name, m in model.named_modules() if type(m) in FUSED]


def _check_fused_off(layout: str, compile_cell: bool, ckpt_chunk: int | None) -> None:
    asked = [k for k, v, d in (("layout", layout, "gates_major"),
                               ("compile_cell", compile_cell, False),
                               ("ckpt_chunk", ckpt_chunk, None)) if v != d]
    if asked:
        raise SchedulingError("", f"{', '.join(asked)} need the fused RNN, but fused=False.",
                              "pass fused=True, or drop " + ", ".join(asked) + ".")


def _check_modules(model: nn.Module) -> list[str]:
    """The paths to replace; raises for modules the fused RNN cannot stand in for."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.LSTM, nn.GRU)) and type(m) not in FUSED:
            raise SchedulingError(name, f"{type(m).__name__} subclasses "
                                  f"{'nn.LSTM' if isinstance(m, nn.LSTM) else 'nn.GRU'}; its "
                                  "forward may differ, so it is not replaced automatically.",
                                  "replace it yourself (sch[path].replace(FusedLSTM.from_module"
                                  "(m))) if its forward is nn.LSTM's, or use the base class.")
        if type(m) is nn.LSTM and m.proj_size:
            raise SchedulingError(name, f"nn.LSTM with proj_size={m.proj_size} is not supported "
                                  "by the fused LSTM.", "use proj_size=0 or leave this model "
                                  "unscheduled.")
    paths = rnn_paths(model)
    if not paths:
        raise SchedulingError("", "the model has no nn.LSTM or nn.GRU to schedule (an RNN "
                              "already fused by apply_rnn is not scheduled twice).",
                              "pass a model containing nn.LSTM / nn.GRU modules.")
    return paths


def _resolve_tp(sch: Schedule, tp: int | None) -> int:
    """The tensor-parallel degree: the schedule's group size; an explicit `tp` must equal it
    (the group, not this argument, decides which ranks hold which shard)."""
    if tp is None:
        return sch.tp_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise SchedulingError("", f"tp must be a positive int, got {tp!r}.",
                              "pass tp=None (the schedule's group size) or that size.")
    if tp != sch.tp_size:
        raise SchedulingError("", f"tp={tp} but the schedule's tensor-parallel group has "
                              f"{sch.tp_size} rank(s).", "create the schedule with a group of "
                              f"{tp} ranks (create_schedule(model, group=...)) or pass "
                              f"tp={sch.tp_size}.")
    return tp


def _module_at(model: nn.Module, path: str, kind: type, what: str) -> nn.Module:
    mods = dict(model.named_modules())
    if not isinstance(path, str) or path not in mods:
        raise SchedulingError(str(path), f"{what}: no module at this path.",
                              "pass a path from model.named_modules().")
    if not isinstance(mods[path], kind):
        raise SchedulingError(path, f"{what} must be an nn.{kind.__name__}, got "
                              f"{type(mods[path]).__name__}.", f"name an nn.{kind.__name__}.")
    return mods[path]


def _feeding_embeddings(model: nn.Module, embeddings: list[str] | None) -> list[str]:
    """Paths of the embeddings to shard (see the module doc for the static rule)."""
    if embeddings is not None:
        for path in embeddings:
            _module_at(model, path, nn.Embedding, "embeddings=")
        return list(embeddings)
    rnns = (nn.LSTM, nn.GRU, *FUSED.values())  # before or after apply_rnn fused them
    sizes = {m.input_size for m in model.modules() if isinstance(m, rnns)}
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Embedding) and m.embedding_dim in sizes]


def _find_head(model: nn.Module, head: str | None, vocabs: set[int]) -> str | None:
    """The output projection's path: `head`, else the one Linear producing a vocabulary."""
    if head is not None:
        _module_at(model, head, nn.Linear, "head=")
        return head
    found = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.out_features in vocabs]
    if len(found) > 1:
        raise SchedulingError("", f"several nn.Linear produce a vocabulary-sized output: "
                              f"{found}; the output projection is ambiguous.",
                              "name it with head='path'.")
    return found[0] if found else None


def _check_vocab_shardable(model: nn.Module, path: str, tensors: list[str], tp: int) -> None:
    mod = dict(model.named_modules())[path]
    if getattr(mod, "max_norm", None) is not None:
        raise SchedulingError(path, "a vocabulary-sharded embedding cannot use max_norm (it "
                              "renormalises whole rows).", "drop max_norm or run with tp=1.")
    for name in tensors:
        t = getattr(mod, name)
        if t is None:
            continue
        if shard_spec(t) is not None:
            raise SchedulingError(path, f"{name!r} is already sharded.",
                                  "apply_rnn(tp=...) shards it; do not shard it beforehand.")
        if t.shape[0] % tp:
            raise SchedulingError(path, f"vocabulary size {t.shape[0]} of {name!r} is not "
                                  f"divisible by tp={tp}.", "pad the vocabulary to a multiple "
                                  f"of {tp} or choose a tensor-parallel degree that divides it.")


def _tp_plan(model: nn.Module, tp: int, head: str | None,
             embeddings: list[str] | None) -> tuple[list[str], str | None]:
    """(embedding paths, head path) to shard; raises before anything is changed."""
    embs = _feeding_embeddings(model, embeddings)
    mods = dict(model.named_modules())
    head_path = _find_head(model, head, {mods[p].num_embeddings for p in embs})
    if not embs and head_path is None:
        raise SchedulingError("", f"tp={tp} shards the vocabulary layers (an nn.Embedding "
                              "feeding an RNN, the output projection), but the model has none.",
                              "name them with embeddings=[...] / head='path', or use tp=1.")
    for p in embs:
        _check_vocab_shardable(model, p, ["weight"], tp)
    if head_path is not None:
        h = mods[head_path]
        tied = any(h.weight is mods[p].weight for p in embs)
        _check_vocab_shardable(model, head_path, ["bias"] if tied else ["weight", "bias"], tp)
    return embs, head_path


def _shard_vocab(sch: Schedule, embs: list[str], head: str | None) -> None:
    """Apply the plan with the `shard` / `sync` primitives (recorded in the history)."""
    for path in embs:
        node = sch[path]
        if shard_spec(node.mod.weight) is None:  # a table shared by two lookups: shard once
            node.shard("weight", axis=0)
        node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    if head is None:
        return
    node = sch[head]
    if shard_spec(node.mod.weight) is None:  # else tied to a sharded embedding
        node.shard("weight", axis=0)
    if node.mod.bias is not None:
        node.shard("bias", axis=0)
    node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    node.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)


def apply_rnn(model_or_sch: nn.Module | Schedule, *, fused: bool = True,
              layout: str = "gates_major", compile_cell: bool = False,
              ckpt_chunk: int | None = None, tp: int | None = None, head: str | None = None,
              embeddings: list[str] | None = None) -> Schedule:
    """Replace every `nn.LSTM` / `nn.GRU` of the model by its fused twin; returns the schedule.

    `layout`: one of `LAYOUTS` ("gates_major", "hidden_major", "batch_minor"; EcoRNN's GEMM
    layout knob); `compile_cell`: run each time step through `torch.compile`; `ckpt_chunk`:
    recompute the recurrence in chunks of this many time steps in backward (None: keep every
    step's activations). `fused=False` leaves the RNNs unfused (the baseline; with tp > 1 only the vocabulary layers are
    sharded).
    `tp`: tensor-parallel degree (None: the schedule's group size; an int must equal it); above
    1 the vocabulary layers are sharded and the recurrence replicated (module doc); `head` /
    `embeddings`: paths of the output projection / the embeddings to shard, when the defaults
    (the Linear producing the vocabulary / the embeddings feeding an RNN) do not fit.
    """
    if not isinstance(model_or_sch, (nn.Module, Schedule)):
        raise SchedulingError("", f"apply_rnn expects an nn.Module or a Schedule, got "
                              f"{type(model_or_sch).__name__}.", "pass the model.")
    if not isinstance(fused, bool):
        raise SchedulingError("", f"fused must be True or False, got {fused!r}.", "pass a bool.")
    check_knobs(layout, compile_cell, ckpt_chunk)
    sch = model_or_sch if isinstance(model_or_sch, Schedule) else create_schedule(model_or_sch)
    tp = _resolve_tp(sch, tp)
    if tp == 1 and (head is not None or embeddings is not None):
        raise SchedulingError("", "head= / embeddings= choose what tensor parallelism shards, "
                              "but the schedule has one rank.", "drop them or use tp > 1.")
    if not fused:
        _check_fused_off(layout, compile_cell, ckpt_chunk)
    paths = _check_modules(sch.mod) if fused else []
    plan = _tp_plan(sch.mod, tp, head, embeddings) if tp > 1 else None
    for path in paths:
        node = sch[path]
        node.replace(FUSED[type(node.mod)].from_module(
            node.mod, layout=layout, compile_cell=compile_cell, ckpt_chunk=ckpt_chunk))
    if plan is not None:
        _shard_vocab(sch, *plan)
    return sch
