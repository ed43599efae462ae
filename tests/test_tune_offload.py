"""Activation offload (`offload_ratio`) in the GPU cost model and the GPU space (issue 36, item
4): the fake step frees what the offloaded layers save and brings it back in backward as the
primitive does (one layer prefetched ahead); the copies run over one host link, overlapped with
compute (`predict_offload.exposed_copy_s`); the space searches ckpt_ratio x offload_ratio and
the memory cap chooses between recomputing and offloading (docs/tune.md, "Activation offload
in the GPU cost model")."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import pytest

from slapo.tune import predict_offload
from slapo.tune.model_spaces import GPU_MODELS, GPUModelSpec, GPUSpaceArgs, gpu_space
from slapo.tune.predict_gpu import H100, GPUCostModel
from slapo.tune.predict_offload import OffloadEvent, exposed_copy_s, offloaded_bytes

# Big enough that a layer's activations pass the primitive's 1 MiB threshold (4 x 1024 x 256
# in bf16 is 2 MiB), small enough for a fake step in seconds.
SMALL = GPUModelSpec("small-llama", "LlamaConfig", "LlamaForCausalLM", dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=512, vocab_size=512, max_position_embeddings=1024), 4, 1024)
BASE = {"batch_size": 4, "mixed_precision": "bf16", "attention": "sdpa"}
MiB = 2**20


@pytest.fixture(scope="module")
def small():
    warnings.simplefilter("ignore")
    return GPUCostModel(SMALL)


def _cfg(compiled: bool, offload: float, ckpt: float = 0.0, policy: str = "full") -> dict:
    c = {**BASE, "compile_blocks": compiled, "ckpt_ratio": ckpt, "offload_ratio": offload}
    return {**c, "ckpt_policy": policy} if ckpt > 0 else c


# ---- the overlap model, on hand-made events ------------------------------------------------------

def _ev(kind: str, key: int, nbytes: int, t: float) -> OffloadEvent:
    return OffloadEvent(kind, key, nbytes, (t, 0.0, 0.0, 0))


def _at(at: tuple) -> float:
    return at[0]


def _two_layers(backward_of_layer_1: float) -> list[OffloadEvent]:
    """Layers 0 and 1 offloaded, one 100-byte tensor each, packed at t=1 and t=2. Backward
    reaches layer 1 at t=3: the primitive prefetches layer 0 and copies layer 1's tensor back
    on demand; layer 0's tensor is read `backward_of_layer_1` later."""
    return [_ev("d2h", 0, 100, 1.0), _ev("d2h", 1, 100, 2.0), _ev("prefetch", 0, 100, 3.0),
            _ev("demand", 1, 100, 3.0), _ev("use", 0, 100, 3.0 + backward_of_layer_1)]


def test_exposed_time_is_what_compute_waits_for_on_one_link():
    # 100 B/s: each copy takes 1 s. Out: [1, 2] and [2, 3], under the forward. Layer 1 comes
    # back on demand [3, 4]: 1 s waited; layer 0's prefetch [4, 5] ends before layer 1's 2 s
    # backward does (at 3 + 1 + 2 = 6): nothing more. One layer's copy is exposed.
    assert exposed_copy_s(_two_layers(2.0), _at, 100.0) == pytest.approx(1.0)
    # a 0.5 s backward of layer 1 hides only half of the prefetch: layer 0's read at 4.5 waits
    # for 5.0
    assert exposed_copy_s(_two_layers(0.5), _at, 100.0) == pytest.approx(1.5)
    # 50 B/s (2 s a copy): out [1, 3] and [3, 5]; layer 1's demand copy waits for its copy out,
    # [5, 7] (4 s waited); the prefetch follows, [7, 9], and layer 0's read (at 7 + 2) is on time
    assert exposed_copy_s(_two_layers(2.0), _at, 50.0) == pytest.approx(4.0)
    # the copies share one link: two tensors packed at once leave one after the other, so the
    # second one's demand copy starts 2 s after they were packed, not 1
    both = [_ev("d2h", 0, 100, 0.0), _ev("d2h", 1, 100, 0.0), _ev("demand", 1, 100, 0.0)]
    assert exposed_copy_s(both, _at, 100.0) == pytest.approx(3.0)
    assert exposed_copy_s([], _at, 0.0) == 0.0
    with pytest.raises(ValueError, match="host_bandwidth"):
        exposed_copy_s(both, _at, 0.0)


def test_h100_host_link_is_pcie_gen5():
    assert 45e9 <= H100.host_bandwidth <= 63e9  # below PCIe Gen5 x16's 63 GB/s raw


# ---- memory: the fake step frees what the offloaded layers save ----------------------------------

@pytest.mark.slow
@pytest.mark.compile
def test_offloaded_layers_leave_the_device_until_their_backward(small, monkeypatch):
    """Compiled layers: each offloaded layer's recorded saved tensors (all above 1 MiB here)
    leave the device at the end of its forward, so the peak (at the start of backward) drops
    by exactly the bytes copied out. With every layer offloaded the peak moves into backward,
    where the primitive holds at most two layers: the one being differentiated and the one
    prefetched; every copy, the last layer's too, comes back by a prefetch."""
    peak = {r: small.step_cost(_cfg(True, r)).peak_bytes for r in (0.0, 0.25, 0.5)}
    out = {r: offloaded_bytes(small.step_cost(_cfg(True, r)).offload) for r in (0.25, 0.5)}
    layer = out[0.25]
    assert layer > MiB and out[0.5] == 2 * layer
    assert peak[0.0] - peak[0.25] == layer and peak[0.0] - peak[0.5] == 2 * layer
    live = {"now": 0, "max": 0}
    copy = predict_offload.OffloadSim._device_copy

    def counted(self, pinned):
        t = copy(self, pinned)
        live["now"] += pinned.nbytes
        live["max"] = max(live["max"], live["now"])
        weakref.finalize(t, lambda n=pinned.nbytes: live.__setitem__("now", live["now"] - n))
        return t

    monkeypatch.setattr(predict_offload.OffloadSim, "_device_copy", counted)
    every = GPUCostModel(SMALL).step_cost(_cfg(True, 1.0))  # (not from the cache)
    assert offloaded_bytes(every.offload) == 4 * layer
    assert live["max"] == 2 * layer  # one layer ahead, each freed with its reader
    # the last layer too: its prefetch starts with the loss's backward (the root's trigger)
    kinds = [e.kind for e in every.offload]
    assert kinds.count("prefetch") == kinds.count("d2h") and "demand" not in kinds
    assert peak[0.0] - 4 * layer < every.peak_bytes < peak[0.0]


@pytest.mark.slow
def test_eager_offload_frees_the_same_bytes_per_layer(small):
    """Eager layers: the pack hook sees every saved tensor; each offloaded layer frees the
    same bytes (identical layers), exactly what it copies out: a tensor two ops save is one
    copy, as in the primitive (50 MiB per layer here; 60 MiB out for the same 50 freed before
    the dedupe)."""
    peak = {r: small.step_cost(_cfg(False, r)).peak_bytes for r in (0.0, 0.25, 0.5)}
    freed = peak[0.0] - peak[0.25]
    assert freed > MiB and peak[0.0] - peak[0.5] == 2 * freed
    assert offloaded_bytes(small.step_cost(_cfg(False, 0.25)).offload) == freed


# ---- time: the copies against compute ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("compiled", [True, False])
def test_offload_adds_only_the_exposed_copy_time(small, compiled):
    """Offloading runs no op of its own: the roofline is unchanged and the step grows by
    exactly the time compute waits for copies. Every copy is prefetched (layer 1, the first
    offloaded layer backward reaches, by the kept layer 2 after it), so a fast link leaves
    nothing exposed (before the trigger, layer 1's demand copies were); a slow one bounds the
    step by the link: every byte goes out and comes back over it."""
    cfg = _cfg(compiled, 0.5)
    off, none = small.step_cost(cfg), small.step_cost(_cfg(compiled, 0.0))
    assert small.roofline_s(off) == small.roofline_s(none)
    p = small.predict(cfg)
    assert p["step_time_s"] == pytest.approx(small.predict(_cfg(compiled, 0.0))["step_time_s"]
                                             + p["offload_wait_s"], rel=1e-12)
    fast = GPUCostModel(SMALL, device=replace(H100, host_bandwidth=1e15))
    fast._cache = small._cache
    kinds = {k: sum(e.nbytes for e in off.offload if e.kind == k) for k in predict_offload.KINDS}
    assert kinds["demand"] == 0 and kinds["prefetch"] == kinds["d2h"] > 0, kinds
    assert fast.predict(cfg)["offload_wait_s"] < 1e-9
    slow = GPUCostModel(SMALL, device=replace(H100, host_bandwidth=1e9))
    slow._cache = small._cache
    waits = [m.predict(cfg)["offload_wait_s"] for m in (fast, small, slow)]
    assert waits == sorted(waits) and waits[2] > 0
    assert slow.predict(cfg)["step_time_s"] >= 2 * offloaded_bytes(off.offload) / 1e9


# ---- the space ---------------------------------------------------------------------------------

def _pairs(space) -> set:
    return {(c["ckpt_ratio"], c.get("offload_ratio")) for c in space}


def test_space_enumerates_ckpt_and_offload_pairs_within_the_layers():
    llama = GPU_MODELS["llama-1b"]  # 16 layers
    args = GPUSpaceArgs(batch_sizes=(8,), mixed_precision=("bf16",), ckpt_policies=("full",),
                        ckpt_ratios=(0.0, 0.5, 1.0))
    assert "offload_ratio" not in gpu_space(llama, args).names()  # not searched by default
    space = gpu_space(llama, replace(args, offload_ratios=(0.0, 0.25, 0.5)))
    # a layer is recomputed or offloaded: all 16 checkpointed leave none to offload
    assert _pairs(space) == {(0.0, 0.0), (0.0, 0.25), (0.0, 0.5), (0.5, 0.0), (0.5, 0.25),
                             (0.5, 0.5), (1.0, 0.0)}
    assert len(space) == 2 * 2 * 2 * 7  # compile_blocks x fused_loss x kernels x the pairs
    only = gpu_space(llama, replace(args, offload_ratios=(0.5,)))  # no ratio fits beside 1.0
    assert _pairs(only) == {(0.0, 0.5), (0.5, 0.5), (1.0, None)}
    # ratios that offload the same layers are one candidate; rounding past the layers left
    three = GPUModelSpec("l3", "LlamaConfig", "LlamaForCausalLM",
                         {**llama.kwargs, "num_hidden_layers": 3}, 1, 8)
    space = gpu_space(three, replace(args, ckpt_ratios=(0.0, 0.5), offload_ratios=(0.0, 0.3,
                                                                                   0.34, 0.5)))
    # of 3 layers: 0.3 and 0.34 offload 1, 0.5 offloads 2; after ckpt 0.5 (2 layers) 1 is left
    assert _pairs(space) == {(0.0, 0.0), (0.0, 0.3), (0.0, 0.5), (0.5, 0.0), (0.5, 0.3)}
    with pytest.raises(ValueError, match="already searches 'offload_ratio'"):
        gpu_space(llama, replace(args, offload_ratios=(0.0, 0.5),
                                 extra=(("offload_ratio", (0.25,)),))).configs()
    # given only as an extra knob, the rule still holds
    extra = gpu_space(llama, replace(args, extra=(("offload_ratio", (0.0, 0.75)),)))
    assert _pairs(extra) == {(0.0, 0.0), (0.0, 0.75), (0.5, 0.0), (1.0, 0.0)}


@pytest.mark.slow
@pytest.mark.compile
def test_memory_cap_chooses_between_recompute_and_offload(small):
    """Under a cap that neither plain layers nor half of them checkpointed meet, only the mix
    (recompute the first half, offload the rest) fits: the cap picks offload. Where checkpointing
    also fits, the link decides: at the H100's PCIe Gen5 the recomputing config is predicted
    faster; with a link ~100x faster, offloading is."""
    def best(model: GPUCostModel, cap_mib: float) -> dict:
        args = GPUSpaceArgs(batch_sizes=(4,), mixed_precision=("bf16",), ckpt_ratios=(0.0, 0.5),
                            ckpt_policies=("full",), offload_ratios=(0.0, 0.5),
                            fits=lambda c: model(c)["memory"] <= cap_mib * MiB)
        space = gpu_space(SMALL, args)
        fitting = [c for c in space if c["compile_blocks"] and not c["fused_loss"]
                   and not c.get("kernels")]
        return max(fitting, key=lambda c: model(c)["throughput"])

    mem = {(ck, off): small(_cfg(True, off, ck))["memory"] / MiB
           for ck, off in ((0.0, 0.0), (0.0, 0.5), (0.5, 0.0), (0.5, 0.5))}
    tight = max(mem[(0.5, 0.5)], min(mem[(0.0, 0.5)], mem[(0.5, 0.0)]) - 1)
    assert mem[(0.5, 0.5)] < tight < min(mem[(0.0, 0.5)], mem[(0.5, 0.0)])
    assert (best(small, tight)["ckpt_ratio"], best(small, tight)["offload_ratio"]) == (0.5, 0.5)
    loose = max(mem[(0.0, 0.5)], mem[(0.5, 0.0)]) + 1
    assert loose < mem[(0.0, 0.0)]
    assert (best(small, loose)["ckpt_ratio"], best(small, loose)["offload_ratio"]) == (0.5, 0.0)
    fast = GPUCostModel(SMALL, device=replace(H100, host_bandwidth=100 * H100.host_bandwidth))
    fast._cache = small._cache
    assert (best(fast, loose)["ckpt_ratio"], best(fast, loose)["offload_ratio"]) == (0.0, 0.5)


@pytest.mark.slow
@pytest.mark.compile
def test_tune_dry_run_lists_offload_configs(monkeypatch, capsys, tmp_path):
    """`slapo tune --space gpu --offload-ratios 0,1 --dry-run`: offload_ratio is a column of
    the predicted space, nothing is measured or written."""
    from slapo.tune import model_spaces
    from slapo.tune.cli import main

    warnings.simplefilter("ignore")
    one = replace(SMALL, name="small1", kwargs={**SMALL.kwargs, "num_hidden_layers": 1})
    monkeypatch.setitem(model_spaces.GPU_MODELS, "small1", one)
    out = tmp_path / "run"
    rc = main(["--space", "gpu", "--model", "small1", "--device", "cpu", "--precisions", "bf16",
               "--batch-sizes", "4", "--ckpt-ratios", "0", "--offload-ratios", "0,1",
               "--dry-run", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "offload_ratio" in text
    rows = [line.split("│") for line in text.splitlines() if "│" in line
            and line.split("│")[1].strip().isdigit()]
    assert len(rows) == 16  # compile_blocks x fused_loss x kernels x offload_ratio
    header = next(line.split("┃") for line in text.splitlines() if "offload_ratio" in line)
    col = [h.strip() for h in header].index("offload_ratio")
    assert sorted(r[col].strip() for r in rows) == ["0.0"] * 8 + ["1.0"] * 8
    assert not out.exists()
