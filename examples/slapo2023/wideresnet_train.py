"""WideResNet training written the Slapo 2023 way (as the 2023 benchmark script looks), native.

2023 names used: torchvision's `ResNet(Bottleneck, layers, width_per_group=...)` under a loss
wrapper (`.model`), `slapo.init_empty_weights(enable=...)`, `model_schedule.apply_schedule(
model, "wideresnet", model_config=(width, layers), prefix="model", ckpt_ratio=...,
bcast_input=True, fuse_conv=...)`, `slapo.build(sch)`, `slapo.get_logger(...).info(...,
ranks=0)`, `slapo.utils.report.report_memory`. See docs/migrating.md for what each does here.

Without torchvision (it cannot be installed beside a CPU-only torch) the same layout comes from
`tests/vision_models.py` (torchvision's module names; `--base-planes` shrinks it for CPU).

    python examples/slapo2023/wideresnet_train.py --steps 5                  # one process (CPU)
    torchrun --nproc-per-node 2 examples/slapo2023/wideresnet_train.py       # TP=2 over gloo
    python examples/slapo2023/wideresnet_train.py --model-name wideresnet-250M --base-planes 64
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import slapo
from slapo.model_schedule import apply_schedule
from slapo.utils.report import report_memory

logger = slapo.get_logger("wideresnet-2023")

SIZES = {"250M": 128, "1.3B": 320, "2.4B": 448, "3B": 512, "4.6B": 640}  # width_per_group


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-name", default="wideresnet-tiny",
                   help="wideresnet-{250M,1.3B,2.4B,3B,4.6B} (layers 6/8/46/6) or -tiny")
    p.add_argument("--base-planes", type=int, default=8, help="64 = torchvision's sizes")
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", type=float, default=0.5, help="activation ckpt ratio")
    p.add_argument("--delay-init", type=int, default=1)
    return p.parse_args(argv)


def get_model_config(name: str) -> tuple[int, list[int]]:
    """(width_per_group, layers), as the 2023 example's `model_config['block_size']`."""
    size = name.split("-", 1)[1]
    if size == "tiny":
        return 128, [2, 1, 2, 1]
    return SIZES[size], [6, 8, 46, 6]


def resnet_classes():
    """torchvision's ResNet and Bottleneck, else the same layout from tests/vision_models.py."""
    try:
        from torchvision.models.resnet import Bottleneck, ResNet

        return ResNet, Bottleneck, False
    except Exception:  # noqa: BLE001 - missing, or its compiled ops fail to load
        path = pathlib.Path(__file__).resolve().parents[2] / "tests" / "vision_models.py"
        spec = importlib.util.spec_from_file_location("vision_models", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.ResNet, mod.Bottleneck, True


class ResNetWithLoss(nn.Module):
    """The 2023 benchmark's wrapper: forward(x, labels) -> {"output", "loss"}."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels=None):
        out = self.model(x)
        return {"output": out, "loss": None if labels is None else F.cross_entropy(out, labels)}


def get_model(width: int, layers: list[int], classes: int, base_planes: int) -> nn.Module:
    resnet, bottleneck, local = resnet_classes()
    if local:
        return ResNetWithLoss(resnet(layers, classes, width, base_planes))
    if base_planes != 64:
        logger.info("torchvision fixes 64 base planes; --base-planes ignored", ranks=0)
    return ResNetWithLoss(resnet(bottleneck, layers, num_classes=classes, width_per_group=width))


def init_dist() -> int:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1


def init_weights(module: nn.Module) -> None:
    """torchvision's init (delayed init materialises with it)."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
        module.reset_running_stats()
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    world = init_dist()
    rank = dist.get_rank() if dist.is_initialized() else 0
    model_config = get_model_config(args.model_name)
    torch.manual_seed(2013)
    with slapo.init_empty_weights(enable=bool(args.delay_init)):
        model = get_model(*model_config, args.classes, args.base_planes)
    sch = apply_schedule(model, "wideresnet", model_config=model_config, prefix="model",
                         ckpt_ratio=args.checkpoint, bcast_input=True,
                         fuse_conv=world == 1)  # 2023 fused on one GPU only
    model, _ = slapo.build(sch, init_weights=init_weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    labels = torch.randint(0, args.classes, (args.batch,), generator=g)
    losses = []
    model.train()
    for step in range(args.steps):
        loss = model(x, labels)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        logger.info(f"step {step} loss {losses[-1]:.4f} (world {world})", ranks=0)
    if rank == 0:
        report_memory("after training")
    return losses


if __name__ == "__main__":
    try:
        main()
    finally:  # the 2023 way out; under gloo it lets the worker threads finish (leave_process_group)
        slapo.cleanup()
