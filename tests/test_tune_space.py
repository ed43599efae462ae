import pytest

from slapo.tune.database import Database, Record
from slapo.tune.space import Space, Symbol, config_key


def make_space():
    space = Space()
    space.create_symbol("batch_size", [8, 16, 32])
    space.create_symbol("checkpoint", [False, True])
    space.create_symbol("ckpt_ratio", [0.5, 1.0], condition=lambda c: c["checkpoint"])
    space.add_constraint(lambda c: c["batch_size"] < 32 or c["checkpoint"], "bs32 needs ckpt")
    return space


def test_enumeration_with_condition_and_constraint():
    configs = make_space().configs()
    # 3 bs x (no-ckpt + 2 ratios) = 9, minus bs=32 without ckpt = 8
    assert len(configs) == 8
    assert {"batch_size": 32, "checkpoint": False} not in configs
    assert all(("ckpt_ratio" in c) == c["checkpoint"] for c in configs)
    assert len({config_key(c) for c in configs}) == 8


def test_dependent_candidates_and_update_space_style():
    def update_space(args, space):
        bs = space.create_symbol("batch_size", args["bs"])
        ckpt = space.create_symbol("checkpoint", [False, True])
        if ckpt == True:  # noqa: E712 - Slapo-style symbol comparison
            # candidates depend on an earlier choice
            space.create_symbol("ckpt_ratio", [0.5, 1.0] if bs.value > 8 else [1.0])
        space.add_constraint(lambda c: c["batch_size"] <= args["max_bs"], "too big")
        return space

    space = Space.from_function(update_space, {"bs": [8, 16, 32], "max_bs": 16})
    configs = space.configs()
    assert configs == [
        {"batch_size": 8, "checkpoint": False},
        {"batch_size": 8, "checkpoint": True, "ckpt_ratio": 1.0},
        {"batch_size": 16, "checkpoint": False},
        {"batch_size": 16, "checkpoint": True, "ckpt_ratio": 0.5},
        {"batch_size": 16, "checkpoint": True, "ckpt_ratio": 1.0},
    ]
    fixed = space.apply({"batch_size": 16, "checkpoint": True, "ckpt_ratio": 0.5})
    assert fixed.symbols["ckpt_ratio"].value == 0.5 and fixed.to_dict()["batch_size"] == 16
    with pytest.raises(ValueError, match="not a candidate"):
        space.apply({"batch_size": 8, "checkpoint": True, "ckpt_ratio": 0.5})
    with pytest.raises(ValueError, match="missing symbol 'checkpoint'"):
        space.apply({"batch_size": 8})
    with pytest.raises(ValueError, match="does not declare"):
        space.apply({"batch_size": 8, "checkpoint": False, "ckpt_ratio": 1.0})


def test_complete_repairs_conditional_symbols():
    space = make_space()
    assert space.complete({"batch_size": 16, "checkpoint": True}) == {
        "batch_size": 16, "checkpoint": True, "ckpt_ratio": 0.5}
    assert space.complete({"batch_size": 16, "checkpoint": False, "ckpt_ratio": 1.0}) == {
        "batch_size": 16, "checkpoint": False}
    assert space.complete({"batch_size": 32, "checkpoint": False}) is None
    assert space.candidates("ckpt_ratio") == [0.5, 1.0]


def test_symbol_semantics_and_errors():
    s = Symbol("bs", [1, 2])
    assert not (s == 1) and not (s < 5)  # unfixed: comparisons are False (Slapo semantics)
    s.fix(2)
    assert s == 2 and s > 1 and s.is_fixed
    with pytest.raises(ValueError, match="not a candidate"):
        s.fix(3)
    with pytest.raises(ValueError, match="no candidate values"):
        Symbol("x", [])
    sp = Space()
    sp.create_symbol("a", [1])
    with pytest.raises(ValueError, match="declared twice"):
        sp.create_symbol("a", [2])
    with pytest.raises(ValueError, match="JSON"):
        config_key({"a": object()})


def test_database_roundtrip_and_resume(tmp_path):
    path = tmp_path / "db.sqlite"
    db = Database(path)
    db.commit(Record({"b": 2, "a": 1}, "ok", {"throughput": 3.0}))
    db.commit(Record({"a": 2, "b": 1}, "oom", error="too big"))
    db.close()
    db = Database(path)
    assert len(db) == 2
    assert db.get({"a": 1, "b": 2}).metrics == {"throughput": 3.0}  # key is order-independent
    assert db.get({"a": 2, "b": 1}).status == "oom"
    assert db.best("throughput").config == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="status"):
        db.commit(Record({"a": 3}, "weird"))


def test_package_exports_are_lazy_and_complete():
    import slapo.tune as tune

    for name in tune.__all__:
        assert getattr(tune, name) is not None
    assert tune.Space is Space and tune.cost.saved_activation_bytes
    with pytest.raises(AttributeError, match="no attribute"):
        tune.nope  # noqa: B018
