"""axonn_c.Conv2d / Conv1D in one process: torch's results and initialisation, the refusals,
and the serial-coordinate boxes the checkpoints use (flat_range_boxes against brute force)."""
import math
import random

import pytest
import torch
from torch import nn

import axonn_c
from axonn_c.linear import flat_block_boxes, flat_range_boxes


@pytest.fixture(autouse=True)
def grid():
    axonn_c.init()
    yield
    axonn_c.finalize()


def test_conv2d_equals_torch_unbatched_and_bfloat16():
    torch.manual_seed(3)
    ref = nn.Conv2d(3, 5, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1))
    torch.manual_seed(3)
    conv = axonn_c.Conv2d(3, 5, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1))
    assert torch.equal(conv.full_weight(), ref.weight) and torch.equal(conv.full_bias(), ref.bias)
    x = torch.randn(3, 9, 8)  # unbatched [C, H, W]
    torch.testing.assert_close(conv(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = conv(x.unsqueeze(0))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref(x.unsqueeze(0)), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(groups=2), "groups=1"),
    (dict(padding_mode="mirror"), "padding_mode"),
    (dict(padding="full"), "padding"),
    (dict(padding="same", stride=2), "strided"),
    (dict(kernel_size=0), "kernel_size"),
])
def test_conv2d_refuses_what_it_does_not_support(kwargs, match):
    args = dict(in_channels=4, out_channels=4, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        axonn_c.Conv2d(**args)


def test_conv2d_input_checks():
    conv = axonn_c.Conv2d(4, 4, 3)
    with pytest.raises(ValueError, match="expects 4 input channels"):
        conv(torch.randn(1, 3, 5, 5))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        conv(torch.randn(1, 4, 2, 2))
    with pytest.raises(ValueError, match="at least 3 dimension"):
        conv(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        conv(torch.randn(1, 1, 4, 5, 5))


def test_conv1d_is_transformers_conv1d():
    """y = x @ W + b with W [in, out]; the same draws as transformers' Conv1D."""
    torch.manual_seed(5)
    w = torch.empty(6, 10).normal_(std=0.02)  # what Conv1D(10, 6) draws
    after = torch.rand(3)
    torch.manual_seed(5)
    c = axonn_c.Conv1D(10, 6)
    assert torch.equal(torch.rand(3), after), "the generator must go on as after the serial draw"
    assert torch.equal(c.full_weight(), w) and torch.equal(c.full_bias(), torch.zeros(10))
    x = torch.randn(2, 3, 6)
    b = torch.randn(10)
    c.load_state_dict({"weight": w, "bias": b})
    torch.testing.assert_close(c(x), x @ w + b)
    with pytest.raises(ValueError, match=r"\[6, 10\]"):
        c.load_full(w.t())


def test_flat_range_boxes_cover_exactly_the_range():
    rng = random.Random(0)
    for _ in range(500):
        inner = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        rows = rng.randint(1, 4)
        total = rows * math.prod(inner)
        lo = rng.randint(0, total)
        hi = rng.randint(lo, total)
        origin = tuple(rng.randint(0, 3) for _ in range(len(inner) + 1))
        shape = tuple(o + d + 1 for o, d in zip(origin, (rows, *inner)))
        want = torch.full(shape, -1)
        block = torch.arange(total)
        block[:lo] = -1
        block[hi:] = -1
        want[tuple(slice(o, o + d) for o, d in zip(origin, (rows, *inner)))] = \
            block.view(rows, *inner)
        got = torch.full(shape, -1)
        boxes = flat_range_boxes(lo, hi, inner, origin)
        assert len(boxes) <= 1 + 2 * len(inner)
        for off, size, a, b in boxes:
            got[tuple(slice(o, o + n) for o, n in zip(off, size))] = \
                torch.arange(lo, hi)[a:b].view(size)
        assert torch.equal(got, want), (inner, rows, lo, hi, origin)
    assert flat_block_boxes(3, 17, 5, 2, 10) == [((2, 13), (1, 2), 0, 2),
                                                 ((3, 10), (2, 5), 2, 12),
                                                 ((5, 10), (1, 2), 12, 14)]


def test_auto_parallelize_swaps_conv2d_and_reports_what_it_keeps():
    with pytest.warns(UserWarning, match=r"kept torch nn.Conv2d.*4x4 \(.*groups=1"):
        with axonn_c.auto_parallelize():
            a = nn.Conv2d(3, 4, 3)
            b = nn.Conv2d(4, 4, 3, groups=2)
            assert isinstance(a, nn.Conv2d) and isinstance(b, nn.Conv2d)
    assert type(a) is axonn_c.Conv2d and type(b) is nn.Conv2d
    assert nn.Conv2d is torch.nn.modules.conv.Conv2d


def test_auto_parallelize_keeps_ties_of_the_same_shard_and_refuses_others():
    with axonn_c.auto_parallelize():
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        b.weight = a.weight  # the same layer shape: one parameter, kept
        assert b.weight is a.weight
        ln = nn.LayerNorm(4)
        with pytest.raises(ValueError, match="cannot tie LayerNorm.weight to a sharded"):
            ln.weight = a.weight
        # as many elements but another serial shape: refused, not silently kept
        c, d = nn.Linear(8, 2), nn.Linear(2, 8)
        with pytest.raises(ValueError, match=r"cannot tie Linear.weight.*serial shape \[2, 8\]"):
            d.weight = c.weight
        # the same shape in another layout
        e = axonn_c.Linear(4, 4, transpose=True)
        with pytest.raises(ValueError, match="transpose=True"):
            a.weight = e.weight
    ln.weight = a.weight  # outside the context: not watched (torch's behaviour)


def test_auto_parallelize_refuses_an_embedding_tied_to_a_linear_weight():
    """nanoGPT ties the other way round (wte.weight = lm_head.weight): the Embedding's shard of
    the table is not the Linear's shard of the same matrix, so it is refused."""
    with axonn_c.auto_parallelize(embeddings=True):
        wte, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        with pytest.raises(ValueError, match="cannot tie Embedding.weight"):
            wte.weight = head.weight
        head.weight = wte.weight  # the supported direction: the head shares the table


def test_transformers_conv1d_is_swapped_only_inside_the_context():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    with axonn_c.auto_parallelize():
        inside = Conv1D(6, 4)
    outside = Conv1D(6, 4)
    assert type(inside) is axonn_c.Conv1D and type(outside) is Conv1D
    assert outside.weight.shape == (4, 6)
    x = torch.randn(3, 4)
    inside.load_state_dict(outside.state_dict())
    torch.testing.assert_close(inside(x), outside(x))
