"""axonn_c.Conv2d against torch's nn.Conv2d on the grids of the world size: outputs, input
gradients, weight and bias gradients (after sync_gradients), both layouts, transpose, a
conv -> conv chain in the expert layout with no redistribution between, full_state_dict /
load_state_dict; and a small UNet-style CNN built under auto_parallelize trained 10 AdamW steps
against serial training (per-step loss within 1e-4)."""
import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import axonn_c
from common import close, grids, train_as_serial


def weight_shard(layer, full):
    """This rank's flat depth piece of a full serial weight, as Linear.load_full cuts it."""
    s = layer._shapes
    rows, cols = layer._block_slices()
    flat = full.reshape(layer.out_features, -1)[rows, cols].reshape(-1)
    padded = flat.new_zeros(s["shard"] * s["depth_size"])
    padded[:s["block"]] = flat
    d = axonn_c.grid().depth_rank
    return padded[d * s["shard"]:(d + 1) * s["shard"]]


def channels(x, layer, which):
    """The expert layout's block of x's channels (dim 1) for `layer`'s input or output."""
    if not layer.expert_mode:
        return x
    s = layer._shapes
    n = layer.local_in_channels if which == "in" else layer.local_out_channels
    r = s["gin_rank"] if which == "in" else s["gout_rank"]
    return x[:, r * n:(r + 1) * n]


def images(g, expert, gen, n, c, h, w):
    """(every image shard, this rank's index): easy, one shard per rank; expert, one per data x
    depth coordinate (the plane holds the same images)."""
    shards = g.G_data * g.G_intra_d if expert else g.world_size
    me = g.data_rank * g.G_intra_d + g.depth_rank if expert else g.rank
    return [torch.randn(n, c, h, w, generator=gen) for _ in range(shards)], me


CASES = (  # (in, out, kernel, stride, padding, dilation, bias, padding_mode)
    (8, 16, 3, 1, 1, 1, True, "zeros"),
    (16, 8, (3, 2), (2, 1), (1, 0), 1, False, "zeros"),
    (8, 8, 3, 1, "same", 2, True, "reflect"),
    (8, 8, 2, 1, "same", 1, True, "zeros"),  # even kernel: torch pads one more on the right
    (8, 16, 1, 2, 0, 1, True, "circular"),
)


def check_conv(g, case, expert, transpose, seed):
    cin, cout, k, stride, padding, dilation, bias, mode = case
    what = (f"Conv2d{case} grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} "
            f"expert={expert} transpose={transpose} rank {g.rank}")
    kw = dict(stride=stride, padding=padding, dilation=dilation, bias=bias, padding_mode=mode)
    torch.manual_seed(seed)
    ref = nn.Conv2d(cin, cout, k, **kw)
    torch.manual_seed(seed)
    conv = axonn_c.Conv2d(cin, cout, k, **kw, expert_mode=expert, transpose=transpose)
    close(conv.full_weight(), ref.weight, what + " full_weight at init", 0)
    gen = torch.Generator().manual_seed(seed)
    xs, me = images(g, expert, gen, 2, cin, 7, 6)
    xs = [x.requires_grad_() for x in xs]
    ys = [ref(x) for x in xs]
    dys = [torch.randn(y.shape, generator=gen) for y in ys]
    sum((y * d).sum() for y, d in zip(ys, dys)).backward()
    x = channels(xs[me].detach(), conv, "in").clone().requires_grad_()
    y = conv(x)
    close(y, channels(ys[me], conv, "out"), what + " output")
    y.backward(channels(dys[me], conv, "out"))
    close(x.grad, channels(xs[me].grad, conv, "in"), what + " dX")
    axonn_c.sync_gradients(conv, expert_mode=expert)
    close(conv.weight.grad, weight_shard(conv, ref.weight.grad), what + " dW")
    if bias:
        close(conv.bias.grad, ref.bias.grad[conv._block_slices()[0]], what + " db")
    sd = axonn_c.full_state_dict(conv)
    for key, v in ref.state_dict().items():
        close(sd[key], v, f"{what} full_state_dict {key}", 0)
    other = {key: torch.randn(v.shape, generator=gen) for key, v in ref.state_dict().items()}
    conv.load_state_dict(other)
    close(conv.full_weight(), other["weight"], what + " load_state_dict", 0)


def check_chain(g, seed):
    """Expert layout: conv (output channels over row) -> relu -> conv(transpose=True) (input
    channels over row): the first one's output block is the second one's input, as is."""
    what = f"conv chain grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 8, 3, padding=1))
    torch.manual_seed(seed)
    par = nn.Sequential(axonn_c.Conv2d(8, 16, 3, padding=1, expert_mode=True), nn.ReLU(),
                        axonn_c.Conv2d(16, 8, 3, padding=1, expert_mode=True, transpose=True))
    gen = torch.Generator().manual_seed(seed)
    xs, me = images(g, True, gen, 2, 8, 5, 5)
    xs = [x.requires_grad_() for x in xs]
    ys = [ref(x) for x in xs]
    sum(y.square().sum() for y in ys).backward()
    x = channels(xs[me].detach(), par[0], "in").clone().requires_grad_()
    y = par(x)
    close(y, channels(ys[me], par[2], "out"), what + " output")
    # the loss of the full output is the sum of the blocks' over the output group
    y.square().sum().backward()
    close(x.grad, channels(xs[me].grad, par[0], "in"), what + " dX")
    axonn_c.sync_gradients(par, expert_mode=True)
    for i in (0, 2):
        close(par[i].weight.grad, weight_shard(par[i], ref[i].weight.grad), f"{what} dW{i}")


class UNet(nn.Module):
    """A small UNet: two resolutions, a skip connection, RGB in, one channel out."""

    def __init__(self, c=8):
        super().__init__()
        self.inc = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.Conv2d(2 * c, c, 1)
        self.dec = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = F.relu(self.inc(x))
        b = F.relu(self.mid(F.relu(self.down(a))))
        u = F.interpolate(self.up(b), scale_factor=2, mode="nearest")
        return self.out(F.relu(self.dec(torch.cat([a, u], dim=1))))


def check_unet(g, seed, steps=10):
    what = f"UNet grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    ref = UNet()
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with axonn_c.auto_parallelize():
            par = UNet()
    convs = [m for m in par.modules() if isinstance(m, (nn.Conv2d, axonn_c.Conv2d))]
    n_par = sum(isinstance(m, axonn_c.Conv2d) for m in convs)
    if n_par < 3:  # (inc's 3 input channels, out's 1 output channel may not divide)
        raise AssertionError(f"{what}: only {n_par} of {len(convs)} convolutions parallel")
    kept = [str(w.message) for w in caught if "auto_parallelize" in str(w.message)]
    if n_par < len(convs) and g.rank == 0 and (len(kept) != 1 or "nn.Conv2d" not in kept[0]):
        raise AssertionError(f"{what}: expected one warning naming the kept convolutions, got "
                             f"{kept}")
    gen = torch.Generator().manual_seed(seed)

    def batches(step):  # an image batch for every rank; the target derived from it
        return [torch.randn(2, 3, 8, 8, generator=gen) for _ in range(g.world_size)]

    train_as_serial(g, ref, par, what, batches,
                    lambda m, x: F.mse_loss(m(x), x.mean(1, keepdim=True).tanh()),
                    steps=steps, lr=1e-2)
    return n_par


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grids", default="all", help="all, or G_data x r x c x d items: 1x2x2x2,...")
    p.add_argument("--unet-only", action="store_true")
    a = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    todo = list(grids(world)) if a.grids == "all" else [
        tuple(int(v) for v in s.split("x")) for s in a.grids.split(",")]
    n = 0
    for sizes in todo:
        g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                         G_intra_d=sizes[3])
        if not a.unet_only:
            for expert in (False, True):
                for transpose in (False, True):
                    for case in CASES:
                        check_conv(g, case, expert, transpose, seed=100 + n)
                        n += 1
            check_chain(g, seed=200 + n)
            n += 1
        check_unet(g, seed=300 + n)
        n += 1
        axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {world}: {len(todo)} grids, {n} conv cases match torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
