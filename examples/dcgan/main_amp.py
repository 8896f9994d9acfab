"""DCGAN under amp: two models, two optimizers, three losses (``num_losses=3``).

A rebuild of Apex's ``examples/dcgan/main_amp.py`` on the amp toolkit. The discriminator's
loss on real images, its loss on generated images and the generator's loss each get their own
loss scaler (``amp.scale_loss(..., loss_id=k)``), as in Apex's example.

Data: scikit-learn's 8x8 handwritten digits upscaled to 32x32 when scikit-learn is installed,
otherwise synthetic digits drawn from a 5x7 bitmap font with random shifts, stroke widths and
noise (``--dataset`` picks; ``--num-images`` sets how many). Every epoch writes a PNG grid of
generated samples (a small PNG writer on the standard library's zlib, so no imaging package is
needed) and prints the Fréchet distance between generated and real images in a fixed
64-dimensional feature space (the images average-pooled to 8x8): lower is better, and it falls
as the generator learns.

Usage:
    python examples/dcgan/main_amp.py --smoke                     # CPU, seconds
    python examples/dcgan/main_amp.py --opt-level O1 --epochs 25 --outf out/

Every epoch prints one line that tests and scripts parse::

    epoch 3/5 loss_d 0.8123 loss_g 1.9034 d_x 0.71 d_g_z 0.30 images/s 950.2 fd 12.345
"""

from __future__ import annotations

import argparse
import logging
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_core import amp

LOG = logging.getLogger("dcgan")

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
IMAGE_SIZE = 32

# 5x7 bitmap glyphs of the digits 0-9, one string of 7 rows x 5 columns each.
GLYPHS = (
    "01110100011001110101110011000101110",
    "00100011000010000100001000010001110",
    "01110100010000100010001000100011111",
    "11111000100010000010000011000101110",
    "00010001100101010010111110001000010",
    "11111100001111000001000011000101110",
    "00110010001000011110100011000101110",
    "11111000010001000100010000100001000",
    "01110100011000101110100011000101110",
    "01110100011000101111000010001001100",
)


# --------------------------------------------------------------------------- data


def digits_sklearn() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N,1,8,8)
    return images, torch.tensor(digits.target)


def digits_synthetic(count: int, seed: int) -> tuple[Tensor, Tensor]:
    """Bitmap-font digits, each shifted, thickened at random and noised: (N, 1, 12, 12)."""
    gen = torch.Generator().manual_seed(seed)
    glyphs = torch.tensor([[float(c) for c in g] for g in GLYPHS]).view(10, 1, 7, 5)
    labels = torch.randint(10, (count,), generator=gen)
    canvas = torch.zeros(count, 1, 12, 12)
    offsets = torch.randint(0, 4, (count, 2), generator=gen)
    for i in range(count):
        y, x = offsets[i].tolist()
        canvas[i, :, y + 1 : y + 8, x + 2 : x + 7] = glyphs[labels[i]]
    thick = torch.rand(count, generator=gen) < 0.5
    canvas[thick] = F.max_pool2d(canvas[thick], (1, 2), stride=1, padding=(0, 1))[..., :12]
    canvas = canvas + 0.1 * torch.rand(canvas.shape, generator=gen)
    return canvas.clamp(0, 1), labels


def load_images(name: str, count: int, seed: int) -> tuple[Tensor, str]:
    """Images (N, 1, 32, 32) in [-1, 1] and the name of the data set used."""
    if name in ("auto", "digits"):
        try:
            images, _ = digits_sklearn()
            images = images[:count]  # the first `count` of the 1797 digits
            name = "digits"
        except ImportError:
            if name == "digits":
                raise RuntimeError(
                    "--dataset digits needs scikit-learn (`pip install scikit-learn`); "
                    "or use --dataset synthetic"
                ) from None
            images, _ = digits_synthetic(count, seed)
            name = "synthetic"
    else:
        images, _ = digits_synthetic(count, seed)
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
    return images.clamp(0, 1) * 2 - 1, name


# --------------------------------------------------------------------------- models


class Generator(nn.Module):
    """z (B, nz, 1, 1) -> image (B, 1, 32, 32) in [-1, 1]."""

    def __init__(self, nz: int, ngf: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),  # (B, 4g, 4, 4)
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # (B, 2g, 8, 8)
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # (B, g, 16, 16)
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False),  # (B, 1, 32, 32)
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    """image (B, 1, 32, 32) -> one logit per image (B,)."""

    def __init__(self, ndf: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False),  # (B, d, 16, 16)
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # (B, 2d, 8, 8)
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),  # (B, 4d, 4, 4)
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False),  # (B, 1, 1, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x).flatten()  # logits, not probabilities: BCE-with-logits is amp-safe


def weights_init(module: nn.Module) -> None:
    """DCGAN's initialisation: N(0, 0.02) convolutions, N(1, 0.02) batch-norm scales."""
    if isinstance(module, nn.Conv2d | nn.ConvTranspose2d):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


# --------------------------------------------------------------------------- metric, PNG


def features(images: Tensor) -> Tensor:
    """(N, 1, 32, 32) -> (N, 64) float64: 4x4 average pooling, a fixed feature map."""
    return F.avg_pool2d(images.float(), 4).flatten(1).double()


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """Fréchet distance between Gaussians fitted to the rows of ``a`` and ``b``.

    ``|mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2)``, computed with
    symmetric eigendecompositions in float64.
    """
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    vals, vecs = torch.linalg.eigh(cov_a)
    root_a = vecs @ torch.diag(vals.clamp(min=0).sqrt()) @ vecs.T
    cross = torch.linalg.eigvalsh(root_a @ cov_b @ root_a).clamp(min=0).sqrt().sum()
    distance = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross
    return float(distance)


def write_png(path: Path, images: Tensor, columns: int) -> None:
    """A grid of (N, 1, H, W) images in [-1, 1] as an 8-bit greyscale PNG."""
    n, _, h, w = images.shape
    rows = (n + columns - 1) // columns
    grid = torch.zeros(rows * (h + 2) + 2, columns * (w + 2) + 2)
    for i in range(n):
        r, c = divmod(i, columns)
        grid[2 + r * (h + 2) : 2 + r * (h + 2) + h, 2 + c * (w + 2) : 2 + c * (w + 2) + w] = images[
            i, 0
        ].float()
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    height, width = pixels.shape
    # Each scanline starts with filter type 0 (None).
    raw = b"".join(b"\x00" + bytes(row.tolist()) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


# --------------------------------------------------------------------------- training


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dataset", choices=("auto", "digits", "synthetic"), default="auto")
    parser.add_argument(
        "--num-images",
        type=int,
        default=4096,
        help="data set size: the synthetic set's, and at most this many of the 1797 digits",
    )
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--nz", type=int, default=64, help="latent size")
    parser.add_argument("--ngf", type=int, default=64)
    parser.add_argument("--ndf", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--optimizer", choices=("adam", "fused_adam"), default="adam")
    parser.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), default="O1")
    parser.add_argument("--loss-scale", type=str, default=None, help='"dynamic" or a number')
    parser.add_argument("--half-dtype", choices=("auto", *HALF_DTYPES), default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--outf", type=Path, default=Path("dcgan_out"), help="PNG folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        # 512 images in batches of 32 and a narrower discriminator: 64 steps, seconds even
        # where bfloat16 convolutions take PyTorch's generic path, and the generator still
        # keeps up with the discriminator in so few.
        smoke = {
            "epochs": 4, "num_images": 512, "batch_size": 32, "ngf": 16, "ndf": 8, "lr": 1e-3,
        }  # fmt: skip
        for key, value in smoke.items():  # flags given explicitly win
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    return args


def make_optimizers(
    args: argparse.Namespace, net_d: nn.Module, net_g: nn.Module
) -> list[torch.optim.Optimizer]:
    betas = (args.beta1, 0.999)
    if args.optimizer == "fused_adam":
        try:
            from amp_optimizers import FusedAdam
        except ImportError as error:
            raise RuntimeError(
                f"--optimizer fused_adam needs amp_optimizers.FusedAdam, which failed to "
                f"import ({error}); install amp-optimizers or use --optimizer adam"
            ) from error
        return [FusedAdam(net.parameters(), lr=args.lr, betas=betas) for net in (net_d, net_g)]
    return [torch.optim.Adam(net.parameters(), lr=args.lr, betas=betas) for net in (net_d, net_g)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    device = torch.device(name)
    half = None if args.half_dtype == "auto" else HALF_DTYPES[args.half_dtype]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loss_scale: str | float | None = args.loss_scale
    if loss_scale not in (None, "dynamic"):
        loss_scale = float(loss_scale)

    data, dataset = load_images(args.dataset, args.num_images, args.seed)
    data = data.to(device)
    torch.manual_seed(args.seed)
    net_g = Generator(args.nz, args.ngf).to(device)
    net_d = Discriminator(args.ndf).to(device)
    net_g.apply(weights_init)
    net_d.apply(weights_init)
    optimizer_d, optimizer_g = make_optimizers(args, net_d, net_g)
    # Apex's pattern: lists in, lists out; one loss scaler per loss.
    [net_d, net_g], [optimizer_d, optimizer_g] = amp.initialize(
        [net_d, net_g],
        [optimizer_d, optimizer_g],
        opt_level=args.opt_level,
        loss_scale=loss_scale,
        num_losses=3,
        verbosity=0,
        half_dtype=half,
    )
    LOG.info(
        "%s: %d images 32x32, %s, opt level %s (models %s), %s, torch %s",
        dataset,
        len(data),
        device,
        args.opt_level,
        str(next(net_g.parameters()).dtype).removeprefix("torch."),
        args.optimizer,
        torch.__version__,
    )

    gen = torch.Generator().manual_seed(args.seed)
    fixed_noise = torch.randn(64, args.nz, 1, 1, generator=gen).to(device)
    eval_noise = torch.randn(len(data), args.nz, 1, 1, generator=gen).to(device)
    real_features = features(data)

    def sample_fd() -> float:
        net_g.eval()
        with torch.no_grad():
            fake = torch.cat([net_g(z) for z in eval_noise.split(256)])
        net_g.train()
        return frechet_distance(features(fake), real_features)

    LOG.info("epoch 0 fd %.3f", sample_fd())
    for epoch in range(args.epochs):
        order = torch.randperm(len(data), generator=gen).to(device)
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        batches = 0
        start = time.perf_counter()
        for index in order.split(args.batch_size):
            real = data[index]
            b = real.shape[0]
            ones = torch.ones(b, device=device)
            zeros = torch.zeros(b, device=device)

            # (1) Discriminator: maximise log D(x) + log(1 - D(G(z))), two losses.
            optimizer_d.zero_grad()
            out_real = net_d(real).float()  # (B,)
            err_d_real = F.binary_cross_entropy_with_logits(out_real, ones)
            with amp.scale_loss(err_d_real, optimizer_d, loss_id=0) as scaled:
                scaled.backward()
            noise = torch.randn(b, args.nz, 1, 1, generator=gen).to(device)
            fake = net_g(noise)  # (B, 1, 32, 32)
            out_fake = net_d(fake.detach()).float()
            err_d_fake = F.binary_cross_entropy_with_logits(out_fake, zeros)
            with amp.scale_loss(err_d_fake, optimizer_d, loss_id=1) as scaled:
                scaled.backward()
            optimizer_d.step()

            # (2) Generator: maximise log D(G(z)), the third loss.
            optimizer_g.zero_grad()
            out_g = net_d(fake).float()
            err_g = F.binary_cross_entropy_with_logits(out_g, ones)
            with amp.scale_loss(err_g, optimizer_g, loss_id=2) as scaled:
                scaled.backward()
            optimizer_g.step()

            sums += torch.stack(
                [
                    (err_d_real + err_d_fake).detach(),
                    err_g.detach(),
                    torch.sigmoid(out_real).mean().detach(),
                    torch.sigmoid(out_fake).mean().detach(),
                ]
            ).double()
            batches += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        loss_d, loss_g, d_x, d_g_z = (sums / batches).tolist()
        fd = sample_fd()
        LOG.info(
            "epoch %d/%d loss_d %.4f loss_g %.4f d_x %.3f d_g_z %.3f images/s %.1f fd %.3f",
            epoch + 1,
            args.epochs,
            loss_d,
            loss_g,
            d_x,
            d_g_z,
            len(data) / elapsed,
            fd,
        )
        net_g.eval()
        with torch.no_grad():
            samples = net_g(fixed_noise)
        net_g.train()
        png = args.outf / f"fake_samples_epoch_{epoch + 1:03d}.png"
        write_png(png, samples, columns=8)
    write_png(args.outf / "real_samples.png", data[:64], columns=8)
    scales = [amp.state_dict()[f"loss_scaler{k}"]["loss_scale"] for k in range(3)]
    LOG.info("samples in %s; loss scales %s", args.outf, scales)
    return 0


if __name__ == "__main__":
    sys.exit(main())
