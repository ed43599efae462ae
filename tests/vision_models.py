"""WideResNet with torchvision's module layout, for tests on machines without torchvision.

torchvision cannot be installed beside this CPU torch (its compiled ops fail to load), so this
file builds the same network from the documented architecture (He et al. 2016, bottleneck
variant; Zagoruyko & Komodakis 2016 for the width): the *same module types, names and nesting*
as `torchvision.models.resnet.ResNet(Bottleneck, ...)`, so a schedule written for torchvision
(`layer3.7.conv2`, `layer2.0.downsample.0`, ...) runs on it unchanged and vice versa:

    conv1 (7x7/2) bn1 relu maxpool  layer1 .. layer4 (nn.Sequential of Bottleneck)  avgpool fc
    Bottleneck: conv1 (1x1) bn1 conv2 (3x3, stride) bn2 conv3 (1x1) bn3 relu [downsample]

`width_per_group` is torchvision's knob: a block's inner width is planes * width_per_group / 64
(wide_resnet50_2 is `width_per_group=128`, layers [3, 4, 6, 3]). `base_planes` (test-only,
default 64 = torchvision) scales the stem and every stage's planes, so tiny test models keep
the layout with a few thousand parameters.

The 2023 benchmark sizes (Slapo's examples/wideresnet: layers [6, 8, 46, 6], the width varied)
are `SIZES_2023`; `param_count(name)` counts them on the meta device (nothing is allocated):

| name | width_per_group | layers | parameters |
|---|---|---|---|
| 250M | 128 | [6, 8, 46, 6] | 250,339,112 |
| 1.3B | 320 | [6, 8, 46, 6] | 1,258,727,720 |
| 2.4B | 448 | [6, 8, 46, 6] | 2,357,871,912 |
| 3B   | 512 | [6, 8, 46, 6] | 3,035,509,544 |
| 4.6B | 640 | [6, 8, 46, 6] | 4,646,915,880 |

(1000 classes; the same skeleton at [3, 4, 6, 3] / 128 counts 68,883,240 = torchvision's
wide_resnet50_2; `tests/test_wideresnet.py` checks the table against the meta-device count.)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES_2023: dict[str, tuple[int, list[int]]] = {
    "250M": (128, [6, 8, 46, 6]),
    "1.3B": (320, [6, 8, 46, 6]),
    "2.4B": (448, [6, 8, 46, 6]),
    "3B": (512, [6, 8, 46, 6]),
    "4.6B": (640, [6, 8, 46, 6]),
}
PARAMS_2023 = {"250M": 250_339_112, "1.3B": 1_258_727_720, "2.4B": 2_357_871_912,
               "3B": 3_035_509_544, "4.6B": 4_646_915_880}


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=k, stride=stride, padding=k // 2, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, as torchvision's "ResNet v1.5"), 1x1 expand x4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, base_width: int = 64):
        super().__init__()
        width = int(planes * (base_width / 64.0))
        self.conv1 = _conv(inplanes, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, planes * self.expansion, 1)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet skeleton over `Bottleneck` blocks (see the module docstring)."""

    def __init__(self, layers: list[int], num_classes: int = 1000, width_per_group: int = 64,
                 base_planes: int = 64):
        super().__init__()
        self.inplanes, self.base_width = base_planes, width_per_group
        self.conv1 = nn.Conv2d(3, base_planes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_planes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(base_planes, layers[0], 1)
        self.layer2 = self._make_layer(base_planes * 2, layers[1], 2)
        self.layer3 = self._make_layer(base_planes * 4, layers[2], 2)
        self.layer4 = self._make_layer(base_planes * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(base_planes * 8 * Bottleneck.expansion, num_classes)
        self._init()

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        out = planes * Bottleneck.expansion
        down = None
        if stride != 1 or self.inplanes != out:
            down = nn.Sequential(_conv(self.inplanes, out, 1, stride), nn.BatchNorm2d(out))
        mods = [Bottleneck(self.inplanes, planes, stride, down, self.base_width)]
        self.inplanes = out
        mods += [Bottleneck(out, planes, base_width=self.base_width) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def _init(self) -> None:
        """torchvision's: Kaiming-normal (fan_out) convolutions, BN weight 1 and bias 0."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNetWithLoss(nn.Module):
    """The 2023 benchmark's wrapper: the ResNet under `.model`, `forward(x, labels)` returning
    a dict with the cross-entropy `loss` (so `apply_schedule(..., prefix="model")`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.model(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def wide_resnet(width_per_group: int = 128, layers: tuple = (3, 4, 6, 3),
                num_classes: int = 1000, base_planes: int = 64, seed: int = 0) -> ResNet:
    """A WideResNet (wide_resnet50_2 by default) initialised from `seed`."""
    torch.manual_seed(seed)
    return ResNet(list(layers), num_classes, width_per_group, base_planes)


def tiny(seed: int = 0, layers: tuple = (2, 1, 2, 1), num_classes: int = 10) -> ResNet:
    """A test-sized WideResNet: base_planes 8, width x2 (width_per_group 128 as
    wide_resnet50_2), so stages have inner widths 16/32/64/128 and 32..256 output channels."""
    return wide_resnet(128, layers, num_classes, base_planes=8, seed=seed)


def images(batch: int = 4, size: int = 32, seed: int = 1, classes: int = 10):
    """(images, labels) of a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), \
        torch.randint(0, classes, (batch,), generator=g)


def param_count(name: str) -> int:
    """Parameters of a 2023 size (`SIZES_2023`), counted on the meta device."""
    width, layers = SIZES_2023[name]
    with torch.device("meta"):
        model = ResNet(layers, 1000, width)
    return sum(p.numel() for p in model.parameters())


def torchvision_wide_resnet(layers=(2, 1, 2, 1), num_classes: int = 10, seed: int = 0):
    """torchvision's own WideResNet class (ResNet + Bottleneck, width x2), small; None when
    torchvision cannot be imported (this CPU environment)."""
    try:
        from torchvision.models.resnet import Bottleneck as TVBottleneck
        from torchvision.models.resnet import ResNet as TVResNet
    except Exception:  # noqa: BLE001 - missing, or its compiled ops fail to load
        return None
    torch.manual_seed(seed)
    return TVResNet(TVBottleneck, list(layers), num_classes=num_classes, width_per_group=128)
