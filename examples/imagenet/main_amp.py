"""ImageNet-style training of a ResNet under amp (O0-O3), optionally data parallel.

A rebuild of Apex's ``examples/imagenet/main_amp.py`` on the amp toolkit. The ResNet is
defined here (no torchvision). Data come from an ImageFolder-style directory
(``root/train/<class>/*.jpg`` and ``root/val/<class>/*.jpg``, decoded with Pillow) or, when no
directory is given, from a deterministic synthetic data set generated on the fly: every class
has its own smooth colour pattern, every image is that pattern shifted at random plus noise,
so the task is learnable and top-1 / top-5 accuracy mean something.

The device is picked automatically (CUDA if present, else CPU); amp uses float16 on CUDA and
bfloat16 on CPU. Under ``torchrun`` every rank trains on its own shard through
``amp_parallel.DistributedDataParallel`` (NCCL on CUDA, Gloo on CPU).

Usage:
    python examples/imagenet/main_amp.py --smoke    # CPU: under a minute on 2 idle cores
    python examples/imagenet/main_amp.py --opt-level O2 --arch resnet50 /data/imagenet
    torchrun --nproc-per-node 2 examples/imagenet/main_amp.py --smoke --sync_bn

Every epoch prints one line that tests and scripts parse::

    epoch 2/3 train_loss 1.2345 images/s 812.3 val_loss 1.0123 top1 61.20 top5 95.40
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from amp_core import amp
from amp_parallel import DistributedDataParallel, convert_syncbn_model

LOG = logging.getLogger("imagenet")

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
# ImageNet channel statistics, used to normalise real images.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------- model


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(inplanes, planes, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)  # stride here (v1.5)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = _shortcut(inplanes, planes * 4, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


def _shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Module:
    if stride == 1 and inplanes == outplanes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes)
    )


class ResNet(nn.Module):
    """ResNet v1.5; ``small_input`` swaps the 7x7/2 stem and max-pool for one 3x3/1 conv."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        widths: Sequence[int],
        num_classes: int,
        *,
        small_input: bool,
    ) -> None:
        super().__init__()
        stem_width = widths[0]
        if small_input:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_width, 3, 1, 1, bias=False),
                nn.BatchNorm2d(stem_width),
                nn.ReLU(inplace=True),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_width, 7, 2, 3, bias=False),  # (B, C, H/2, W/2)
                nn.BatchNorm2d(stem_width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),  # (B, C, H/4, W/4)
            )
        stages: list[nn.Module] = []
        inplanes = stem_width
        for index, (blocks, width) in enumerate(zip(layers, widths, strict=False)):
            stride = 1 if index == 0 else 2
            for b in range(blocks):
                stages.append(block(inplanes, width, stride if b == 0 else 1))
                inplanes = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init the last BN of each residual branch: every block starts as the identity.
        for module in self.modules():
            if isinstance(module, Bottleneck):
                nn.init.zeros_(module.bn3.weight)
            elif isinstance(module, BasicBlock):
                nn.init.zeros_(module.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))  # (B, C, h, w)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # (B, classes)


ARCHS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...], tuple[int, ...]]] = {
    "resnet_tiny": (BasicBlock, (1, 1, 1), (16, 32, 64)),
    "resnet_small": (BasicBlock, (2, 2, 2), (32, 64, 128)),
    "resnet18": (BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512)),
    "resnet34": (BasicBlock, (3, 4, 6, 3), (64, 128, 256, 512)),
    "resnet50": (Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512)),
}


def build_model(arch: str, num_classes: int, image_size: int) -> ResNet:
    block, layers, widths = ARCHS[arch]
    return ResNet(block, layers, widths, num_classes, small_input=image_size <= 64)


# --------------------------------------------------------------------------- data


class SyntheticImages(Dataset[tuple[Tensor, int]]):
    """Deterministic, learnable images: a per-class smooth pattern, shifted, plus noise.

    Sample ``i`` of a split is a pure function of ``(seed, split, i)``, so every rank, every
    epoch and every resumed run sees the same image for the same index.
    """

    def __init__(
        self, num_classes: int, image_size: int, length: int, seed: int, split: int, noise: float
    ) -> None:
        self.num_classes, self.image_size, self.length = num_classes, image_size, length
        self.seed, self.split, self.noise = seed, split, noise
        gen = torch.Generator().manual_seed(seed)
        # Low-frequency patterns: 4x4 random colours upsampled to the image size.
        coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
        self.patterns = F.interpolate(
            coarse, size=(image_size, image_size), mode="bicubic", align_corners=False
        )  # (classes, 3, S, S)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.split) * 10_000_019 + index
        )
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        shift = self.image_size // 8
        dy, dx = torch.randint(-shift, shift + 1, (2,), generator=gen).tolist()
        image = torch.roll(self.patterns[label], shifts=(dy, dx), dims=(1, 2))
        noise = torch.randn(image.shape, generator=gen)
        return image + self.noise * noise, label


class ImageFolder(Dataset[tuple[Tensor, int]]):
    """``root/<class>/<image>`` decoded with Pillow, resized, centre-cropped, normalised."""

    def __init__(self, root: Path, image_size: int, *, train: bool) -> None:
        try:
            from PIL import Image  # noqa: F401
        except ImportError as error:
            raise RuntimeError(
                f"reading the image directory {root} needs Pillow, which is not installed; "
                "run `pip install pillow`, or leave out the data directory to train on the "
                "synthetic data set"
            ) from error
        classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
        if not classes:
            raise ValueError(
                f"no class folders in {root}; expected {root}/<class name>/<image files>"
            )
        self.classes = classes
        self.samples = [
            (path, label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).rglob("*"))
            if path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        if not self.samples:
            raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
        self.image_size, self.train = image_size, train
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
            # Resize the short side to size * 8/7 (256 for 224), then centre-crop.
            short = round(self.image_size * 8 / 7)
            scale = short / min(img.size)
            img = img.resize(
                (max(short, round(img.width * scale)), max(short, round(img.height * scale)))
            )
            left = (img.width - self.image_size) // 2
            top = (img.height - self.image_size) // 2
            img = img.crop((left, top, left + self.image_size, top + self.image_size))
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        image = data.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float() / 255.0
        if self.train and torch.rand(()) < 0.5:
            image = image.flip(2)
        return (image - self.mean) / self.std, label


def build_datasets(args: argparse.Namespace) -> tuple[Dataset[tuple[Tensor, int]], ...]:
    if args.data is None:
        train = SyntheticImages(
            args.num_classes, args.image_size, args.train_size, args.data_seed, 0, args.noise
        )
        val = SyntheticImages(
            args.num_classes, args.image_size, args.val_size, args.data_seed, 1, args.noise
        )
        return train, val
    root = Path(args.data)
    for sub in ("train", "val"):
        if not (root / sub).is_dir():
            raise ValueError(
                f"{root / sub} is not a directory; expected {root}/train and {root}/val"
            )
    train_set = ImageFolder(root / "train", args.image_size, train=True)
    args.num_classes = len(train_set.classes)
    return train_set, ImageFolder(root / "val", args.image_size, train=False)


# --------------------------------------------------------------------------- training


@dataclass
class Dist:
    rank: int
    world: int
    distributed: bool


def setup(args: argparse.Namespace) -> tuple[torch.device, Dist]:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    if distributed:
        dist.init_process_group(backend="nccl" if name == "cuda" else "gloo")
    device = torch.device(name)
    if name == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        return device, Dist(dist.get_rank(), dist.get_world_size(), True)
    return device, Dist(0, 1, False)


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "fused_adam":
        try:
            from amp_optimizers import FusedAdam
        except ImportError as error:
            raise RuntimeError(
                f"--optimizer fused_adam needs amp_optimizers.FusedAdam, which failed to "
                f"import ({error}); install amp-optimizers or use --optimizer sgd"
            ) from error
        return FusedAdam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )


def lr_at(args: argparse.Namespace, epoch: int, step: int, steps_per_epoch: int) -> float:
    """Linear warm-up over the first epoch, then cosine decay; a pure function of the step."""
    progress = (epoch + step / steps_per_epoch) / args.epochs
    warmup = 1.0 / args.epochs if args.epochs > 1 else 0.0
    if progress < warmup:
        return args.lr * progress / warmup
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (1.0 - warmup)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[tuple[Tensor, int]],
    epoch: int,
    args: argparse.Namespace,
    device: torch.device,
    world: Dist,
) -> tuple[float, float]:
    """One pass over this rank's shard; returns (mean loss over all ranks, images/s all ranks)."""
    model.train()
    total_loss = torch.zeros((), device=device, dtype=torch.float64)
    seen = 0
    sync(device)
    start = time.perf_counter()
    for step, (images, labels) in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args, epoch, step, len(loader))
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        logits = model(images)  # (B, classes)
        loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        total_loss += loss.detach() * labels.numel()
        seen += labels.numel()
    sync(device)
    elapsed = time.perf_counter() - start
    stats = torch.tensor([total_loss.item(), float(seen), elapsed], dtype=torch.float64)
    if world.distributed:
        stats = stats.to(device)
        times = stats[2:].clone()
        dist.all_reduce(stats[:2])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        stats[2] = times[0]
        stats = stats.cpu()
    return float(stats[0] / stats[1]), float(stats[1] / stats[2])


@torch.no_grad()
def validate(
    model: nn.Module,
    loader: DataLoader[tuple[Tensor, int]],
    device: torch.device,
    world: Dist,
) -> tuple[float, float, float]:
    """Returns (val loss, top-1 %, top-5 %) over the whole validation set (all ranks)."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images).float()  # (B, classes)
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices  # (B, k)
        hits = topk == labels[:, None]
        sums[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        sums[1] += hits[:, 0].sum()
        sums[2] += hits.any(dim=1).sum()
        sums[3] += labels.numel()
    if world.distributed:
        dist.all_reduce(sums)
    loss, top1, top5, count = sums.tolist()
    return loss / count, 100.0 * top1 / count, 100.0 * top5 / count


def save_checkpoint(
    path: Path,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    best: float,
) -> None:
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    state = {
        "epoch": epoch,  # epochs completed
        "arch": args.arch,
        "opt_level": args.opt_level,
        "state_dict": bare.state_dict(),
        "optimizer": optimizer.state_dict(),
        "amp": amp.state_dict(),  # loss scale(s) and their counters
        "best_top1": best,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # never leave a half-written checkpoint behind


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("data", nargs="?", default=None, help="ImageFolder root; none: synthetic")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("-b", "--batch-size", type=int, default=256, help="per process")
    parser.add_argument(
        "--lr", type=float, default=None, help="default: 0.1 x batch/256 (SGD), 1e-3 (Adam)"
    )
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--optimizer", choices=("sgd", "fused_adam"), default="sgd")
    parser.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), default="O1")
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None, help='"True" or "False"')
    parser.add_argument("--loss-scale", type=str, default=None, help='"dynamic" or a number')
    parser.add_argument("--half-dtype", choices=("auto", *HALF_DTYPES), default="auto")
    parser.add_argument("--sync_bn", action="store_true", help="convert BatchNorm to SyncBatchNorm")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000, help="synthetic data only")
    parser.add_argument("--train-size", type=int, default=128_000, help="synthetic data only")
    parser.add_argument("--val-size", type=int, default=10_000, help="synthetic data only")
    parser.add_argument("--noise", type=float, default=1.0, help="synthetic data: noise std")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="weights and batch order")
    parser.add_argument("--checkpoint", type=Path, default=None, help="saved after every epoch")
    parser.add_argument("--resume", type=Path, default=None, help="checkpoint to continue from")
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end after this many epochs in total, as a preempted job would; the learning-rate "
        "schedule still spans --epochs, so --resume picks up exactly where it stopped",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU-sized run: resnet_tiny, 16x16 images, 10 classes, 3 epochs",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        smoke = {
            "arch": "resnet_tiny", "epochs": 3, "batch_size": 32, "image_size": 16,
            "num_classes": 10, "train_size": 512, "val_size": 256, "workers": 0, "lr": 0.2,
        }  # fmt: skip
        for key, value in smoke.items():  # flags given explicitly win
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "fused_adam" else 0.1 * args.batch_size / 256
    return args


def parse_flag(value: str | None) -> bool | None:
    if value is None:
        return None
    if value not in ("True", "False"):
        raise ValueError(f'--keep-batchnorm-fp32 takes "True" or "False", got {value!r}')
    return value == "True"


def parse_loss_scale(value: str | None) -> float | str | None:
    if value is None or value == "dynamic":
        return value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f'--loss-scale takes "dynamic" or a number, got {value!r}') from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device, world = setup(args)
    logging.basicConfig(
        level=logging.INFO if world.rank == 0 else logging.WARNING,
        format="%(message)s",
        stream=sys.stdout,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    half_dtype = None if args.half_dtype == "auto" else HALF_DTYPES[args.half_dtype]

    train_set, val_set = build_datasets(args)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts anyway)
    model = build_model(args.arch, args.num_classes, args.image_size)
    if args.sync_bn:
        model = convert_syncbn_model(model)  # before amp.initialize, as with Apex
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(args, model)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=args.opt_level,
        keep_batchnorm_fp32=parse_flag(args.keep_batchnorm_fp32),
        loss_scale=parse_loss_scale(args.loss_scale),
        verbosity=0,
        half_dtype=half_dtype,
    )
    start_epoch, best_top1 = 0, 0.0
    if args.resume is not None:
        # Apex's order: amp.initialize first, then restore model, optimizer and amp state.
        checkpoint = torch.load(args.resume, map_location=device, weights_only=False)
        if checkpoint["arch"] != args.arch:
            raise ValueError(
                f"{args.resume} holds a {checkpoint['arch']} model but --arch is {args.arch}; "
                f"pass --arch {checkpoint['arch']}"
            )
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        start_epoch, best_top1 = checkpoint["epoch"], checkpoint["best_top1"]
        LOG.info("resumed from %s at epoch %d", args.resume, start_epoch)
    if world.distributed:
        model = DistributedDataParallel(model)  # after amp.initialize, as with Apex

    train_sampler = DistributedSampler(train_set, seed=args.seed) if world.distributed else None
    val_sampler = DistributedSampler(val_set, shuffle=False) if world.distributed else None
    loader_gen = torch.Generator()
    train_loader: DataLoader[tuple[Tensor, int]] = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=train_sampler is None,
        sampler=train_sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        generator=loader_gen,
        persistent_workers=args.workers > 0,
    )
    val_loader: DataLoader[tuple[Tensor, int]] = DataLoader(
        val_set,
        batch_size=args.batch_size,
        sampler=val_sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
    )
    model_dtype = next(model.parameters()).dtype
    LOG.info(
        "%s, %s, opt level %s (model %s, amp half %s), %s, world %d, %d train / %d val images "
        "of %dx%d, %d classes, torch %s",
        args.arch,
        device,
        args.opt_level,
        str(model_dtype).removeprefix("torch."),
        args.half_dtype if half_dtype else ("float16" if device.type == "cuda" else "bfloat16"),
        args.optimizer,
        world.world,
        len(train_set),  # type: ignore[arg-type]
        len(val_set),  # type: ignore[arg-type]
        args.image_size,
        args.image_size,
        args.num_classes,
        torch.__version__,
    )

    last_epoch = args.epochs if args.stop_after is None else min(args.stop_after, args.epochs)
    for epoch in range(start_epoch, last_epoch):
        loader_gen.manual_seed(args.seed + epoch)  # batch order depends on the epoch only
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        train_loss, images_per_s = train_epoch(
            model, optimizer, train_loader, epoch, args, device, world
        )
        val_loss, top1, top5 = validate(model, val_loader, device, world)
        best_top1 = max(best_top1, top1)
        LOG.info(
            "epoch %d/%d train_loss %.4f images/s %.1f val_loss %.4f top1 %.2f top5 %.2f",
            epoch + 1,
            args.epochs,
            train_loss,
            images_per_s,
            val_loss,
            top1,
            top5,
        )
        if args.checkpoint is not None and world.rank == 0:
            save_checkpoint(args.checkpoint, epoch + 1, model, optimizer, args, best_top1)
    LOG.info("best top1 %.2f, loss scale %s", best_top1, amp.state_dict()["loss_scaler0"])

    if world.distributed:
        # Free what holds the process group (the DDP reducer above all) before destroying
        # it, so no Gloo thread outlives the group and aborts the process at exit.
        del model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
