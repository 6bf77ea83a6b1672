"""axonn_c.Conv2d and the transformers Conv1D: layers that are an axonn_c.Linear in another
shape (docs/layers.md#conv2d).

A 2-D convolution is a matrix product over the unfolded input (im2col): every output pixel is
`W [Cout, Cin*kh*kw] @ patch [Cin*kh*kw]`. Conv2d is an axonn_c.Linear(Cin*kh*kw, Cout) applied
to the patches, so the weight is flattened and depth-sharded exactly like a Linear weight, the
output channels are split over the row group and the input channels over the column group (the
Tensor3D paper's layout), and forward and backward are the Linear's C calls and collectives.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.utils import _pair

from . import validate
from .linear import Linear, flat_range_boxes
from .state import grid, grid_sizes

_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _groups_for(transpose: bool) -> Tuple[int, int, str, str]:
    """(input-channel group size, output-channel group size, their names) on the current grid."""
    grid()  # raises before init()
    _, g_r, g_c, _ = grid_sizes()
    return (g_r, g_c, "row", "col") if transpose else (g_c, g_r, "col", "row")


class Conv2d(Linear):
    """Drop-in for nn.Conv2d (groups=1), sharded over the grid of axonn_c.init().

    The weight `[Cout, Cin, kh, kw]` is the weight `[Cout, Cin*kh*kw]` of an axonn_c.Linear
    (flattened in the same order), split by output channels over the row group, by input
    channels over the column group (swapped with `transpose=True`) and depth-sharded; the
    `weight` parameter is this rank's flat depth piece. Cin must divide by the input-channel
    group and Cout by the output-channel group.

    Easy layout (default): every rank passes its own images `[N, Cin, H, W]` and gets
    `[N, Cout, Ho, Wo]`. Expert layout (`expert_mode=True`): the input is this rank's block of
    input channels `[N, Cin/G_in, H, W]` (the same images on the plane; images split over data x
    depth) and the output its block of output channels `[N, Cout/G_out, Ho, Wo]`; a
    `transpose=True` layer takes what a normal one returns, so conv -> conv alternating
    `transpose` needs no redistribution.

    stride, padding (ints, pairs, 'same', 'valid'), dilation, bias and padding_mode are
    PyTorch's; groups > 1 is refused (ValueError). The full weight and bias are initialised as
    nn.Conv2d's: a serial nn.Conv2d built after the same torch.manual_seed holds the same ones.
    The patches are materialised (kh*kw times the input, as im2col): fine for the small kernels
    of a UNet, not a replacement for cuDNN's direct convolutions.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device=None, dtype=None, *, transpose: bool = False, expert_mode: bool = False,
                 init_method=None):
        in_channels = validate.check_int("Conv2d: in_channels", in_channels, 1, 2**31 - 1)
        out_channels = validate.check_int("Conv2d: out_channels", out_channels, 1, 2**31 - 1)
        if groups != 1:
            raise ValueError(f"axonn_c.Conv2d supports groups=1 only, got groups={groups!r}: use "
                             "torch.nn.Conv2d for grouped or depthwise convolutions")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"Conv2d: padding_mode must be one of {list(_PADDING_MODES)}, got "
                             f"{padding_mode!r}")
        kernel, stride_, dilation_ = _pair(kernel_size), _pair(stride), _pair(dilation)
        for name, v in (("kernel_size", kernel), ("stride", stride_), ("dilation", dilation_)):
            if len(v) != 2 or any(not isinstance(i, int) or i < 1 for i in v):
                raise ValueError(f"Conv2d: {name} must be a positive int or a pair of them, got "
                                 f"{v!r}")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"Conv2d: padding must be 'same', 'valid', an int or a pair, got "
                                 f"{padding!r}")
            if padding == "same" and stride_ != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions")
            padding_ = padding
            totals = [d * (k - 1) if padding == "same" else 0 for d, k in zip(dilation_, kernel)]
        else:
            padding_ = _pair(padding)
            if len(padding_) != 2 or any(not isinstance(p, int) or p < 0 for p in padding_):
                raise ValueError(f"Conv2d: padding must be a non-negative int or a pair of them, "
                                 f"got {padding!r}")
            totals = [2 * p for p in padding_]
        g_in, g_out, n_in, n_out = _groups_for(bool(transpose))
        if in_channels % g_in or out_channels % g_out:
            raise ValueError(f"axonn_c.Conv2d({in_channels}, {out_channels}): in_channels must "
                             f"divide by the {n_in} group ({g_in} ranks) and out_channels by the "
                             f"{n_out} group ({g_out} ranks)")
        kk = kernel[0] * kernel[1]
        init = None
        if init_method is not None:  # it gets the full weight in the serial layer's shape
            def init(w):
                init_method(w.view(out_channels, in_channels, *kernel))
        super().__init__(in_channels * kk, out_channels, bias=bias, transpose=transpose,
                         expert_mode=expert_mode, init_method=init, device=device, dtype=dtype)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = kernel, stride_, dilation_
        self.padding, self.groups, self.padding_mode = padding_, 1, padding_mode
        # (left, right, top, bottom) as F.pad takes them; 'same' puts the odd one on the right
        self._pad4 = (totals[1] // 2, totals[1] - totals[1] // 2,
                      totals[0] // 2, totals[0] - totals[0] // 2)
        self._tag_layout()  # (now that its serial shape is known)

    @property
    def serial_weight_shape(self) -> Tuple[int, ...]:
        return (self.out_channels, self.in_channels, *self.kernel_size)

    @property
    def local_in_channels(self) -> int:
        """The input channels an expert-layout call takes (the block of this rank's group)."""
        return self.in_channels // self._shapes["gin_size"]

    @property
    def local_out_channels(self) -> int:
        return self.out_channels // self._shapes["gout_size"]

    def weight_pieces(self, flat: Tensor) -> list:
        """As Linear.weight_pieces, in the serial [out, in, kh, kw] weight: the depth shard's
        piece of this rank's block (n_local output channels x local input channels x kernel)."""
        s = self._shapes
        lo = grid().depth_rank * s["shard"]
        cin = self.local_in_channels
        boxes = flat_range_boxes(lo, min(lo + s["shard"], s["block"]), (cin, *self.kernel_size),
                                 (s["gout_rank"] * s["n_local"], s["gin_rank"] * cin, 0, 0))
        return [(off, size, flat[a:b].view(size)) for off, size, a, b in boxes]

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Optional[Tensor] = None) -> None:
        """Loads this rank's shard from the full serial weight [out, in, kh, kw] (and bias)."""
        if tuple(weight.shape) != self.serial_weight_shape:
            raise ValueError(f"full Conv2d weight must be {list(self.serial_weight_shape)}, got "
                             f"{list(weight.shape)}")
        super().load_full(weight.reshape(self.out_channels, -1), bias)

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full [out, in, kh, kw] weight on every rank (collective over the intra group)."""
        return super().full_weight().view(self.serial_weight_shape)

    def forward(self, x: Tensor) -> Tensor:
        validate.check_tensor("Conv2d: input", x, 3)
        if x.dim() not in (3, 4):
            raise ValueError(f"axonn_c.Conv2d expects [N, C, H, W] or [C, H, W], got input of "
                             f"shape {list(x.shape)}")
        if x.dim() == 3:  # unbatched, as nn.Conv2d (this class's forward: a subclass's may
            return Conv2d.forward(self, x.unsqueeze(0)).squeeze(0)  # take other arguments)
        want = self.local_in_channels if self.expert_mode else self.in_channels
        if x.shape[1] != want:
            layout = (f"expert layout: in_channels/{self._shapes['gin']} group = "
                      f"{self.in_channels}/{self._shapes['gin_size']}") if self.expert_mode \
                else "in_channels"
            raise ValueError(f"axonn_c.Conv2d expects {want} input channels ({layout}), got input "
                             f"of shape {list(x.shape)}")
        pad = self._pad4
        if self.padding_mode != "zeros":
            x, unfold_pad = F.pad(x, pad, mode=self.padding_mode), (0, 0)
        elif pad[0] == pad[1] and pad[2] == pad[3]:
            unfold_pad = (pad[2], pad[0])
        else:  # ('same' with an even extent: one more on the right, as torch)
            x, unfold_pad = F.pad(x, pad), (0, 0)
        n, c, h, w = x.shape
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        ho = (h + 2 * unfold_pad[0] - dh * (kh - 1) - 1) // sh + 1
        wo = (w + 2 * unfold_pad[1] - dw * (kw - 1) - 1) // sw + 1
        if ho < 1 or wo < 1:
            raise ValueError(f"axonn_c.Conv2d: the input {list(x.shape)} (padded) is smaller than "
                             f"the dilated kernel {list(self.kernel_size)}")
        # [N, C*kh*kw, L] -> one row per output pixel, its patch in the weight's (C, kh, kw) order
        cols = F.unfold(x, self.kernel_size, self.dilation, unfold_pad, self.stride)
        rows = cols.transpose(1, 2).reshape(n * ho * wo, c * kh * kw)
        y = super().forward(rows)
        return y.view(n, ho, wo, y.shape[-1]).permute(0, 3, 1, 2).contiguous()

    def extra_repr(self) -> str:
        s = self._shard_shapes
        out = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
               f"stride={self.stride}")
        if self.padding != (0, 0):
            out += f", padding={self.padding!r}"
        if self.dilation != (1, 1):
            out += f", dilation={self.dilation}"
        if self.padding_mode != "zeros":
            out += f", padding_mode={self.padding_mode!r}"
        return out + (f", bias={self.bias is not None}, transpose={self.transpose}, "
                      f"expert_mode={self.expert_mode}, shard={s['shard']}")


class Conv1D(Linear):
    """Drop-in for transformers' `Conv1D(nf, nx)` (GPT-2's projections): `y = x @ W + b` with
    the weight stored `[nx, nf]` = `[in, out]`, an axonn_c.Linear(nx, nf) on the transposed
    weight (easy layout). The state dict, `full_weight()` and checkpoints use the serial
    `[in, out]` weight. Initialised as transformers' (normal, std 0.02, zero bias) with the
    same random draws: a serial Conv1D built after the same seed holds the same weight.
    auto_parallelize() builds it for transformers' Conv1D."""

    def __init__(self, nf: int, nx: int, device=None, dtype=None):
        nf = validate.check_int("Conv1D: nf", nf, 1, 2**31 - 1)
        nx = validate.check_int("Conv1D: nx", nx, 1, 2**31 - 1)
        after_draw = []

        def init(w):  # the serial layer's draw, on its [nx, nf] tensor
            w.copy_(torch.empty(nx, nf).normal_(std=0.02).t())
            after_draw.append(torch.get_rng_state())

        super().__init__(nx, nf, bias=True, init_method=init, device=device, dtype=dtype)
        # the serial layer's bias is zeros, not a draw: the generator goes on from where the
        # serial one would (Linear drew a bias after the weight)
        torch.set_rng_state(after_draw[0])
        with torch.no_grad():
            self.bias.zero_()
        self.nf, self.nx = nf, nx
        self._tag_layout()  # (now that its serial shape is known)

    @property
    def serial_weight_shape(self) -> Tuple[int, ...]:
        return (self.nx, self.nf)

    def weight_pieces(self, flat: Tensor) -> list:
        """As Linear.weight_pieces, transposed into the serial [in, out] weight."""
        return [((off[1], off[0]), (size[1], size[0]), view.t())
                for off, size, view in super().weight_pieces(flat)]

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Optional[Tensor] = None) -> None:
        """Loads this rank's shard from the serial weight [nx, nf] (and bias [nf])."""
        if tuple(weight.shape) != (self.nx, self.nf):
            raise ValueError(f"full Conv1D weight must be [{self.nx}, {self.nf}] ([in, out]), "
                             f"got {list(weight.shape)}")
        super().load_full(weight.t(), bias)

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full [nx, nf] weight on every rank (collective over the intra group)."""
        return super().full_weight().t().contiguous()

    def __repr__(self) -> str:
        return f"axonn_c.Conv1D(nf={self.nf}, nx={self.nx}, shard={self._shard_shapes['shard']})"


__all__ = ["Conv2d", "Conv1D"]
