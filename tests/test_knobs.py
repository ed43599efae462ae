"""The schedule-knob schema is the one declaration: `apply`, `slapo train` (flags, TOML, help) and
`slapo tune` (spaces, `--knob`) all derive from it, and every knob has one meaning."""

from __future__ import annotations

import copy
import inspect
from dataclasses import fields

import pytest
import torch

from slapo import model_schedule
from slapo.cli import _parser, load_toml, main, parse_train_args
from slapo.errors import SchedulingError
from slapo.model_schedule import knobs
from slapo.model_schedule.knobs import KnobError, ScheduleKnobs

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=16, batch_size=2, steps=1,
            progress=False, eval_batches=0)


def _flags(parser_name: str = "train") -> set[str]:
    sub = _parser()._subparsers._group_actions[0].choices[parser_name]
    return {s for a in sub._actions for s in a.option_strings}


# ---- one declaration ------------------------------------------------------------------------
def test_schema_fields_are_exactly_applys_knobs():
    params = inspect.signature(model_schedule.apply).parameters
    keyword = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"group", "mesh"}
    assert set(knobs.names()) == keyword
    for f in knobs.knob_fields():  # same defaults, one help text, a kind for the parsers
        assert params[f.name].default == f.default, f.name
        assert f.metadata["help"] and f.metadata["kind"] in knobs.KINDS
    # the defaults are written once: `apply`'s own `def` declares no knob (its signature is
    # generated from the schema), so a default changed in knobs.py is the one apply runs with
    code = model_schedule.apply.__code__
    assert code.co_kwonlyargcount == 2 and code.co_flags & inspect.CO_VARKEYWORDS


def test_train_flags_and_config_fields_are_the_schema():
    from slapo.train.config import SECTIONS, TrainConfig, config_fields, option_fields

    # the schedule section IS the schema: its fields are the schema's Field objects
    assert SECTIONS["schedule"] is ScheduleKnobs
    assert [f for s, f in option_fields() if s == "schedule"] == list(knobs.knob_fields())
    assert [f.name for f in fields(TrainConfig)] == list(SECTIONS)  # sections, declared
    assert set(config_fields()) == {f.name for cls in SECTIONS.values() for f in fields(cls)}
    for _, f in option_fields():  # one help text per option, nowhere else
        assert f.metadata["help"], f.name
    flags = _flags()
    for name in knobs.names():
        dashed = "--" + name.replace("_", "-")
        assert dashed in flags, dashed
        if knobs.spec(name)["kind"] == "bool":
            assert "--no-" + name.replace("_", "-") in flags
    help_text = _parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "Megatron sequence parallelism" in " ".join(help_text.split())  # the schema's help


def test_toml_keys_round_trip(tmp_path):
    """Every knob as a TOML key (under [schedule], `-` or `_`) comes back as the same value."""
    values = {"tp": 1, "ckpt_ratio": 0.25, "ckpt_policy": "selective", "offload_ratio": 0.5,
              "attention": "sdpa",
              "fuse": False, "fuse_compiler": "aot_eager", "tempo": True, "pp_stages": 1,
              "sequence_parallel": True, "vocab_parallel": False, "compile_blocks": False,
              "fused_loss": True, "kernels": True, "cp_attention": "ring"}
    assert set(values) == set(knobs.names())

    def toml(v):
        return str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')

    path = tmp_path / "run.toml"
    path.write_text("[schedule]\n" + "\n".join(f"{k.replace('_', '-')} = {toml(v)}"
                                               for k, v in values.items()))
    assert load_toml(str(path)) == values
    cfg = parse_train_args(["--config", str(path)])
    assert {k: getattr(cfg, k) for k in values} == values
    assert cfg.schedule_knobs().as_kwargs() == values


def test_tune_space_symbols_are_schema_fields():
    from slapo.tune.model_spaces import (
        BUILD_KNOBS,
        GPU_MODELS,
        SpaceArgs,
        cpu_space_knobs,
        gpu_space,
        make_space,
    )

    allowed = set(knobs.names()) | {"batch_size", *BUILD_KNOBS}
    cpu = make_space("gpt2")
    assert set(cpu.names()) <= allowed
    for name in cpu_space_knobs():  # default candidates are the schema's
        assert tuple(cpu.candidates(name)) == knobs.tune_candidates(name), name
    gpu = gpu_space(GPU_MODELS["llama-1b"])
    assert set(gpu.names()) <= allowed
    extra = make_space("gpt2", SpaceArgs(batch_sizes=(2,), extra=(("sequence_parallel",
                                                                   (False, True)),)))
    assert extra.candidates("sequence_parallel") == [False, True]


def test_tune_knob_option(tmp_path, capsys):
    from slapo.tune.cli import _space

    args = _parser().parse_args(["tune", "--knob", "vocab-parallel=off,on", "--knob",
                                 "kernels=true", "--batch-sizes", "2"])
    args.model = "gpt2"
    space = _space(args)
    assert space.candidates("vocab_parallel") == [False, True]
    assert space.candidates("kernels") == [True]
    with pytest.raises(SystemExit) as e:
        main(["tune", "--knob", "ckpt_ratio=2", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "ckpt_ratio must be a number in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--knob", "warp_speed=1", "--out", str(tmp_path)])
    assert "no schedule knob" in capsys.readouterr().err
    assert main(["tune", "--knob", "fuse=true", "--out", str(tmp_path)]) == 2
    assert "already searches 'fuse'" in capsys.readouterr().err


def test_train_command_of_a_tuned_config():
    from slapo.tune.report import train_command

    cmd = train_command({"batch_size": 4, "attention": "sdpa", "fuse": True, "tempo": False,
                         "ckpt_ratio": 0.5, "mixed_precision": "bf16"}, {"model": "gpt2"})
    assert cmd == ("slapo train --model gpt2 --batch-size 4 --attention sdpa --fuse --no-tempo "
                   "--ckpt-ratio 0.5 --precision bf16")
    assert parse_train_args(cmd.split()[2:]).knobs() == {"attention": "sdpa", "fuse": True,
                                                         "tempo": False, "ckpt_ratio": 0.5}


# ---- validate -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, knob, fix", [
    (dict(ckpt_ratio=1.5), "ckpt_ratio", "ckpt_ratio=0.5"),
    (dict(ckpt_ratio=True), "ckpt_ratio", "ckpt_ratio=0.5"),
    (dict(tp=0), "tp", "tp=1"),
    (dict(pp_stages=1.0), "pp_stages", "pp_stages=1"),
    (dict(attention="fast"), "attention", "eager, sdpa, flash"),
    (dict(ckpt_policy="some"), "ckpt_policy", "full, selective"),
    (dict(fuse="yes"), "fuse", "fuse=True or fuse=False"),
    (dict(vocab_parallel=None), "vocab_parallel", "vocab_parallel=True"),
    (dict(compile_blocks=3), "compile_blocks", "compile_blocks=True"),
    (dict(fuse=True, compile_blocks=True), "fuse", "fuse=False"),
    (dict(fused_loss=True, tp=2), "fused_loss", "vocab_parallel=False"),
    (dict(sequence_parallel=True, pp_stages=2), "sequence_parallel", "pipeline stages"),
])
def test_validate_names_the_knob_and_the_fix(kw, knob, fix):
    with pytest.raises(KnobError) as e:
        ScheduleKnobs(**kw).validate()
    assert e.value.knob == knob and knob in str(e.value) and fix in e.value.fix


@pytest.mark.parametrize("kw", [dict(ckpt_ratio=-0.1), dict(attention="fast"),
                                dict(fuse=True, compile_blocks=True), dict(tempo=1),
                                dict(sequence_parallel=True, pp_stages=2)])
def test_apply_rejects_bad_knobs_before_any_mutation(kw):
    import models

    model = models.gpt2()
    before = copy.deepcopy(model.state_dict())
    modules = [type(m) for m in model.modules()]
    sch = __import__("slapo").create_schedule(model)
    with pytest.raises(SchedulingError):
        model_schedule.apply(sch, **kw)
    assert [type(m) for m in model.modules()] == modules
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config._attn_implementation != "slapo_core"


def test_from_given_rejects_unknown_names():
    with pytest.raises(KnobError, match="unknown schedule knob"):
        ScheduleKnobs.from_given({"warp": 9})
    assert ScheduleKnobs.from_given({"tp": 2}).validate().tp == 2


# ---- one meaning of attention ---------------------------------------------------------------
def _train_model(**knob):
    from slapo.train.assemble import build
    from slapo.train.config import TrainConfig
    from slapo.train.setup import setup

    cfg = TrainConfig(**TINY, **knob)
    cfg.check()
    return build(cfg, setup(cfg), log=lambda *a: None).model


def _impl(model) -> str:
    """The attention implementation every HF attention module dispatches to (one value)."""
    from slapo.op import is_hf_attention

    impls = {m.config._attn_implementation for m in model.modules() if is_hf_attention(m)}
    assert len(impls) == 1, impls
    return impls.pop()


def test_attention_eager_means_hf_eager_in_train_and_tune():
    """`--attention eager` runs HF's eager attention (it ran HF's SDPA before), as a tune trial
    with attention="eager" and the progressive demo's eager baseline do; not given keeps the
    model's own implementation; sdpa installs Slapo's core everywhere."""
    from slapo.tune.evaluators import TrialSettings, build_scheduled_model

    default = _train_model()
    assert _impl(default) != "eager"  # HF's default (SDPA) when the knob is not given
    assert _impl(_train_model(attention="eager")) == "eager"
    settings = TrialSettings(model="gpt2", hidden_size=32, num_layers=2, num_heads=2, seq_len=16)
    assert _impl(build_scheduled_model(settings, {"attention": "eager"})) == "eager"
    assert _impl(_train_model(attention="sdpa")) == "slapo_core"
    assert _impl(build_scheduled_model(settings, {"attention": "sdpa"})) == "slapo_core"


def test_attention_eager_computes_what_hf_eager_computes():
    """apply(attention="eager") on an SDPA-built model gives the eager model's logits and
    gradients (outputs AND gradients against the unscheduled eager reference)."""
    import models

    ref, model = models.gpt2(seed=0), models.gpt2(seed=0)
    ref.set_attn_implementation("eager")
    model.set_attn_implementation("sdpa")
    model_schedule.apply(model, attention="eager")
    x = torch.randint(0, 100, (2, 16))
    out_ref, out = ref(input_ids=x, labels=x), model(input_ids=x, labels=x)
    out_ref.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=0, atol=0)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=n)


def test_eager_over_installed_cores_is_rejected():
    import models

    model = models.gpt2()
    model_schedule.apply(model, attention="sdpa")
    with pytest.raises(SchedulingError, match="already run Slapo attention cores"):
        model_schedule.apply(model, attention="eager")
