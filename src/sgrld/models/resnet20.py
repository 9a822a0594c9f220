"""Google ResNet-20 for CIFAR-10 with BatchNorm, ported like the reference from google-research
``cold_posterior_bnn`` (272,474 parameters), without torchvision.
"""

from __future__ import annotations

from torch import Tensor, nn

from sgrld.models.fc import check_positive


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """3×3 convolution, padding 1, no bias."""
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm2d with PyTorch's defaults (momentum 0.1, eps 1e-5), as in the reference."""
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)


class BasicBlock(nn.Module):
    """ReLU(BN(conv(ReLU(BN(conv_s(x))))) + shortcut(x)), shortcut = conv1×1_s → BN if needed."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn1 = batch_norm(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.bn2 = batch_norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                batch_norm(out_channels),
            )
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """Google ResNet-20: input NCHW (32×32 for CIFAR-10), output logits; sample in ``train()`` mode,
    evaluate in ``eval()`` mode (BatchNorm). Global average pooling is the reference AvgPool2d(8).

    Args:
        num_classes: number of logits.
        in_channels: input channels (3 for CIFAR-10).
        widths: filters per stage.
        blocks_per_stage: BasicBlocks per stage (3 gives depth 6·3 + 2 = 20).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: tuple[int, int, int] = (16, 32, 64),
        blocks_per_stage: int = 3,
    ) -> None:
        super().__init__()
        check_positive("num_classes", num_classes)
        check_positive("in_channels", in_channels)
        check_positive("blocks_per_stage", blocks_per_stage)
        for width in widths:
            check_positive("widths", width)
        self.stem = nn.Sequential(conv3x3(in_channels, widths[0]), batch_norm(widths[0]), nn.ReLU())
        stages, channels = [], widths[0]
        for index, width in enumerate(widths):
            blocks = []
            for block in range(blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))
