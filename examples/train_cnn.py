"""Train a small UNet-style CNN (image denoising) with axonn_c's parallel Conv2d.

    python examples/train_cnn.py                                              # one process
    torchrun --standalone --nproc_per_node 4 examples/train_cnn.py            # CPU, grid 1x2x2x1
    torchrun --standalone --nproc_per_node 8 examples/train_cnn.py --G-intra-d 2 --device cuda

The model is plain PyTorch (nn.Conv2d); three things make it parallel: `axonn_c.init(grid)`,
building it inside `axonn_c.auto_parallelize()` (every nn.Conv2d whose channels divide by the
grid becomes an axonn_c.Conv2d: output channels over the row group, input channels over the
column group, the flattened weight depth-sharded, as the Tensor3D paper's UNet) and
`axonn_c.sync_gradients(model, mean=True)` after backward. The first convolution (3 input
channels) and the last (1 output channel) stay torch's where they do not divide, as
auto_parallelize's warning says. Every rank trains on its own images (the easy layout); the
data is generated: noisy images of random discs and boxes, the target the clean image.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import axonn_c  # noqa: E402
from train_gpt import default_grid  # noqa: E402  (the same grid flags as the GPT example)


class UNet(nn.Module):
    """Two levels down, two up, skip connections; `c` channels at full resolution."""

    def __init__(self, c: int = 16):
        super().__init__()

        def block(cin, cout, stride=1):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

        self.inc = block(3, c)
        self.down1 = block(c, 2 * c, stride=2)
        self.down2 = block(2 * c, 4 * c, stride=2)
        self.up2 = nn.Conv2d(4 * c, 2 * c, 1)
        self.dec2 = block(4 * c, 2 * c)
        self.up1 = nn.Conv2d(2 * c, c, 1)
        self.dec1 = block(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        a = self.inc(x)
        b = self.down1(a)
        m = self.down2(b)
        u2 = F.interpolate(self.up2(m), scale_factor=2, mode="nearest")
        d2 = self.dec2(torch.cat([b, u2], dim=1))
        u1 = F.interpolate(self.up1(d2), scale_factor=2, mode="nearest")
        return self.out(self.dec1(torch.cat([a, u1], dim=1)))


def make_images(n: int, size: int, gen: torch.Generator):
    """(noisy, clean) RGB images [n, 3, size, size]: a disc and a box of random colours on a
    dark background, plus Gaussian noise."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    clean = torch.zeros(n, 3, size, size)
    for i in range(n):
        cx, cy, r = torch.randint(size // 4, 3 * size // 4, (3,), generator=gen).tolist()
        disc = ((xx - cx) ** 2 + (yy - cy) ** 2 <= (r // 2 + 2) ** 2).float()
        x0, y0 = torch.randint(0, size // 2, (2,), generator=gen).tolist()
        box = torch.zeros(size, size)
        box[y0:y0 + size // 3, x0:x0 + size // 3] = 1.0
        for shape in (disc, box):
            colour = torch.rand(3, 1, 1, generator=gen)
            clean[i] = torch.where(shape.bool(), colour, clean[i])
    noisy = clean + 0.3 * torch.randn(clean.shape, generator=gen)
    return noisy, clean


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    grid_help = "grid size (default: 2x2 tensor parallelism, data parallelism over the rest)"
    p.add_argument("--G-data", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-r", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-c", type=int, default=None, help=grid_help)
    p.add_argument("--G-intra-d", type=int, default=None, help=grid_help)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
    p.add_argument("--size", type=int, default=32, help="image side (divisible by 4)")
    p.add_argument("--channels", type=int, default=16, help="channels at full resolution")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    args = p.parse_args(argv)
    if args.size % 4:
        p.error(f"--size must divide by 4 (two down-samplings), got {args.size}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    G_data, G_r, G_c, G_d = default_grid(world, args)
    g = axonn_c.init(G_data=G_data, G_intra_r=G_r, G_intra_c=G_c, G_intra_d=G_d)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else \
        torch.device("cpu")
    torch.manual_seed(args.seed)  # the same full weights on every rank (and as serial)
    with axonn_c.auto_parallelize():
        model = UNet(args.channels).to(device)
    if g.rank == 0:
        n_par = sum(isinstance(m, axonn_c.Conv2d) for m in model.modules())
        n_all = sum(isinstance(m, (nn.Conv2d, axonn_c.Conv2d)) for m in model.modules())
        print(f"grid {G_data}x{G_r}x{G_c}x{G_d}: {n_par} of {n_all} convolutions parallel",
              flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + g.rank)  # every rank its own images
    for step in range(args.steps):
        noisy, clean = make_images(args.batch_size, args.size, gen)
        loss = F.mse_loss(model(noisy.to(device)), clean.to(device))
        loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            mean = loss.detach().reshape(1).clone()
            axonn_c.comm.all_reduce(mean, group="world")
            if g.rank == 0:
                print(f"step {step:5d}  loss {mean.item() / g.world_size:.4f}", flush=True)
    axonn_c.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
