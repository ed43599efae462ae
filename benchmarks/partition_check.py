"""What one compiled layer keeps for backward on the device, next to what the GPU cost model
records for it on CPU (docs/tune.md, "GPU cost model vs H100": compiled rows over-predict
peak memory by 6-12% and the cause is open).

    python benchmarks/partition_check.py --out partition.json            # on the GPU
    python benchmarks/partition_check.py --tiny --device cpu              # CPU smoke run

Per model (`slapo.tune.model_spaces.GPU_MODELS`, the benchmark's batch and sequence) and per
checkpoint mode of `compile_blocks` (none, selective): the *recorded* bytes are
`partition_plan.record_partition` on fake tensors exactly as `predict_gpu` records them (CPU autocast
with CUDA's op lists); the *real* bytes come from `torch.compile(layer)` (inductor, the
device's own partitioner and joint passes) on real tensors under CUDA bf16 autocast: the tensors
its compiled autograd node holds, each storage once, parameters and the layer's inputs excluded,
and, as a second reading, `memory_allocated()` held across the forward minus the output. Every
real saved tensor's shape and dtype is written to the JSON, so a difference can be named.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = {"tiny-llama": "llama-1b", "tiny-gpt2": "gpt2-medium"}


def _spec(name: str):
    from dataclasses import replace

    from slapo.tune.model_spaces import GPU_MODELS

    if name in TINY:  # the same family at a size a CPU compiles in seconds
        big = GPU_MODELS[TINY[name]]
        small = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
                 "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 64,
                 "max_position_embeddings": 64}
        kwargs = {k: small.get(k, v) for k, v in big.kwargs.items()}
        return replace(big, kwargs=kwargs, batch=2, seq=32)
    return GPU_MODELS[name]


def _first_layer(model):
    base = getattr(model, "model", None) or getattr(model, "transformer", None) \
        or getattr(model, "bert", None)
    if hasattr(base, "layers"):
        return base.layers[0]
    if hasattr(base, "h"):
        return base.h[0]
    return base.encoder.layer[0]


def recorded(spec, mode: str) -> int:
    """The cost model's saved bytes for the first layer (as `predict_gpu` records them)."""
    from slapo.tune.partition_plan import record_partition
    from slapo.tune.predict_gpu import (
        _autocast,
        _fake_batch,
        _fake_model,
        _layer_call,
        _layer_fn,
        cuda_autocast_lists,
        fake_mode,
    )

    cfg = {"batch_size": spec.batch, "mixed_precision": "bf16"}
    with cuda_autocast_lists(cfg), fake_mode():
        model = _fake_model(spec)
        data = _fake_batch(model, spec.batch, spec.seq)
        layer = _first_layer(model)
        args, kwargs = _layer_call(model, layer, cfg, data)
        with _autocast(cfg):
            return record_partition(_layer_fn(layer, mode), args, kwargs).saved_bytes


def real(spec, mode: str, device: str) -> dict:
    """What inductor's compiled layer keeps on `device` (real tensors, bf16 autocast)."""
    import torch
    from torch.utils._pytree import tree_flatten

    from slapo.tune.predict_gpu import _fake_batch, _fake_model, _layer_call, _layer_fn

    torch.manual_seed(0)
    model = _fake_model(spec).to(device)
    data = {k: v.to(device) for k, v in _fake_batch(model, spec.batch, spec.seq).items()}
    layer = _first_layer(model)
    cfg = {"batch_size": spec.batch, "mixed_precision": "bf16"}
    args, kwargs = _layer_call(model, layer, cfg, data,
                               autocast=torch.autocast(device, dtype=torch.bfloat16))
    fn = torch.compile(_layer_fn(layer, mode), dynamic=False)
    with torch.autocast(device, dtype=torch.bfloat16):
        fn(*args, **kwargs)  # compile and warm up
        if device == "cuda":
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        out = fn(*args, **kwargs)
        held = (torch.cuda.memory_allocated() - before) if device == "cuda" else None
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    node = outs[0].grad_fn
    while node is not None and "Compiled" not in type(node).__name__:
        node = node.next_functions[0][0] if node.next_functions else None
    free = {t.untyped_storage()._cdata for t in list(layer.parameters()) +
            [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]}
    kept: dict = {}
    tensors = []
    for t in (node.saved_tensors if node is not None else ()):
        if not isinstance(t, torch.Tensor):
            continue
        key = t.untyped_storage()._cdata
        if key in free or key in kept:
            continue
        kept[key] = t.untyped_storage().nbytes()
        tensors.append({"shape": list(t.shape), "dtype": str(t.dtype), "bytes": kept[key]})
    out_bytes = sum(t.untyped_storage().nbytes() for t in outs)
    return {"saved_bytes": sum(kept.values()), "saved": tensors,
            "held_minus_output": None if held is None else held - out_bytes,
            "node": None if node is None else type(node).__name__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b,gpt2-medium,bert-large")
    p.add_argument("--modes", default="none,selective")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny LLaMA and GPT-2 (CPU smoke run)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    models = list(TINY) if args.tiny else args.models.split(",")
    rows = []
    print(f"{'model':12} {'mode':10} {'recorded MiB':>13} {'real MiB':>9} {'held MiB':>9} "
          f"{'rec/real':>8}")
    for name in models:
        spec = _spec(name)
        for mode in args.modes.split(","):
            t0 = time.time()
            try:
                rec = recorded(spec, mode)
                got = real(spec, mode, args.device)
            except Exception as e:  # noqa: BLE001 - one failed row must not stop the others
                rows.append({"model": name, "mode": mode, "error": f"{type(e).__name__}: {e}"})
                print(f"{name:12} {mode:10} error: {type(e).__name__}: {e}")
                continue
            row = {"model": name, "mode": mode, "recorded_bytes": rec, **got,
                   "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            held = got["held_minus_output"]
            print(f"{name:12} {mode:10} {rec / 2**20:13.1f} {got['saved_bytes'] / 2**20:9.1f} "
                  f"{'-' if held is None else f'{held / 2**20:9.1f}':>9} "
                  f"{rec / max(got['saved_bytes'], 1):8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
