"""Error feedback on the depth dW reduce-scatters (tests/test_compress_depth_ef.py), launched by
torchrun on 4 ranks over grids with G_intra_d 2 and 4, overlap off and on.

--mode identity: Linear -> tanh -> Linear for a few steps with int4 on "depth" (init's policy,
  or the first layer's own); the weight gradients received over the steps are compared with the
  exact ones, computed here from each layer's input and output gradient (dY^T X summed over the
  world, exact fp32). With error feedback the reduce-scatter's telescoping sum holds: the summed
  gradients plus the residuals still held (summed over the depth group, piece by piece, and
  over data) equal the exact sum, to fp32 rounding; the residuals are nonzero. With
  error_feedback=False no residual is kept and the same comparison misses by int4's error (the
  assertion that fails without error feedback). On grids with G_data 1 the gradient
  accumulates in .grad over the steps (overlap on: the deferred reduce-scatter's dw_prev);
  else it is zeroed each step and summed here. The data replicas' gradients are identical.
--mode checkpoint --dir D: trains with int4 depth + error feedback and SGD (a
  torch.autograd.grad of the input in between leaves the residuals alone), saves
  (axonn_c.checkpoint), trains on; then drops the residuals, loads, checks they are back bitwise
  and trains the same steps again: the weights equal the uninterrupted run's bitwise. Also the
  compression_state(model) round trip and its errors (no model, another layer shape).
"""
import argparse
import gc
import os

import torch
from torch import nn

import axonn_c
import axonn_c.checkpoint as ckpt

GRIDS = [(1, 1, 1, 4), (1, 1, 2, 2), (2, 1, 1, 2)]
STEPS = 6
INT4 = {"depth": "int4"}
INT4_NO_EF = {"depth": {"codec": "int4", "error_feedback": False}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = axonn_c.Linear(32, 64), axonn_c.Linear(64, 16)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def exact_shard(layer, x, dy):
    """The layer's weight-gradient shard from its input x [t, in] and output gradient dy
    [t, out] on every rank: dY^T X summed over the world (exact fp32), this rank's block and
    depth piece (as Linear.load_full slices the weight)."""
    full = dy.t() @ x
    axonn_c.comm.all_reduce(full, group="world")
    s = layer._shapes
    rows, cols = layer._block_slices()
    padded = full.new_zeros(s["shard"] * s["depth_size"])
    padded[: s["block"]] = full[rows, cols].reshape(-1)
    d = axonn_c.grid().depth_rank
    return padded[d * s["shard"]:(d + 1) * s["shard"]]


def held(layer, residual):
    """What the residuals of the depth group (and the data replicas) still hold of this rank's
    gradient piece: piece d of their sum."""
    if residual is None:
        return 0
    s, d = layer._shapes, axonn_c.grid().depth_rank
    r = residual.clone()
    axonn_c.comm.all_reduce(r, group="depth")
    piece = r[d * s["shard"]:(d + 1) * s["shard"]].contiguous()
    axonn_c.comm.all_reduce(piece, group="data")
    return piece


def identity_run(grid, overlap, policy, own):
    """(max error of the summed gradients against the exact sum, with the held residuals added
    back, relative to the exact sum's largest value), per layer; and the depth residuals."""
    g = axonn_c.init(*grid, overlap=overlap, compression=policy)
    try:
        torch.manual_seed(0)
        net = Net()
        net.l1.compression = own
        layers = (net.l1, net.l2)
        seen = {}
        for i, layer in enumerate(layers):
            def fwd_hook(mod, inp, out, i=i):
                seen[i] = [inp[0].detach(), None]
                out.register_hook(lambda grad, i=i: seen[i].__setitem__(1, grad.detach()))
            layer.register_forward_hook(fwd_hook)
        accumulate = g.G_data == 1
        got = [0, 0]
        want = [0, 0]
        gen = torch.Generator().manual_seed(100 + g.rank)
        for _ in range(STEPS):
            x = torch.randn(8, 32, generator=gen)
            y = net(x)
            y.square().sum().backward()
            axonn_c.sync_gradients(net)
            for i, layer in enumerate(layers):
                want[i] = want[i] + exact_shard(layer, *seen[i])
                grad = layer.weight.grad
                every = torch.empty(g.G_data * grad.numel())
                axonn_c.comm.all_gather(every, grad.contiguous(), group="data")
                assert all(torch.equal(o, grad) for o in every.view(g.G_data, -1)), grid
                if not accumulate:
                    got[i] = got[i] + grad
            if not accumulate:
                net.zero_grad(set_to_none=True)
        if accumulate:
            got = [layer.weight.grad.clone() for layer in layers]
        assert axonn_c.comm_stats()["depth"]["compressed_calls"] > 0
        residuals = axonn_c.compression_state(net)["depth"]
        errors = []
        for i, (name, layer) in enumerate((("l1", net.l1), ("l2", net.l2))):
            r = residuals.get(name)
            diff = (got[i] + held(layer, r) - want[i]).abs().max().item()
            errors.append(diff / want[i].abs().max().item())
        # the residuals are C's (by layer id): none is kept for in-flight work once the passes
        # ended, and a collected layer's goes with it
        assert axonn_c._C.grad_layer_residuals_kept() == 0
        del net, layers, layer, seen
        gc.collect()
        assert axonn_c._C.grad_layer_residuals_held() == 0, grid
        return errors, residuals
    finally:
        axonn_c.finalize()


def check_trains_error(grid):
    """An error from autograd's answer to whether a dW reaches a .grad (grads.accumulates, which
    the layer handle's backward asks for its error-feedback residual) stops that backward before
    its collectives and reaches the caller (was: the call went on with the exception set and ran
    its compressed depth collectives, training the layer's residual with a dW thrown away)."""
    from axonn_c import grads
    axonn_c.init(*grid, compression=INT4)
    try:
        torch.manual_seed(0)
        net = Net()
        x = torch.randn(8, 32)
        net(x).square().sum().backward()  # (warm: the residuals exist)
        y = net(x).square().sum()
        before = axonn_c.comm_stats()["depth"]["calls"]

        def refuse(p):
            raise ValueError("accumulates refused (test)")

        real, grads.accumulates = grads.accumulates, refuse
        try:
            y.backward()
            raise AssertionError("the error of grads.accumulates did not reach backward()")
        except ValueError as e:
            assert "accumulates refused" in str(e), e
        finally:
            grads.accumulates = real
        ran = axonn_c.comm_stats()["depth"]["calls"] - before
        assert ran == 0, f"{ran} depth collectives ran in the backward that raised"
    finally:
        axonn_c.finalize()


def check_identity():
    for grid in GRIDS:
        for overlap in (False, True):
            what = f"grid {grid} overlap {overlap}"
            # init's policy: both layers; the first layer's own policy: that layer only (the
            # second stays exact, whose reduce-scatter then holds the identity with no residual)
            for policy, own, ef_layers in ((INT4, None, ("l1", "l2")),
                                           (None, INT4, ("l1",))):
                errors, residuals = identity_run(grid, overlap, policy, own)
                assert sorted(residuals) == sorted(ef_layers), (what, sorted(residuals))
                for name in ef_layers:
                    assert residuals[name].abs().max().item() > 0, (what, name)
                    assert residuals[name].dtype == torch.float32
                for name, err in zip(("l1", "l2"), errors):
                    assert err < 1e-4, f"{what} own={own}: {name} misses the exact sum by {err}"
            errors, residuals = identity_run(grid, overlap, INT4_NO_EF, None)
            assert residuals == {}, (what, sorted(residuals))
            for name, err in zip(("l1", "l2"), errors):
                assert err > 1e-3, f"{what}: without error feedback {name} is within {err}"
    check_trains_error(GRIDS[0])
    if int(os.environ["RANK"]) == 0:
        print(f"depth_ef identity: {len(GRIDS)} grids ok", flush=True)


def train(net, opt, steps, gen):
    for _ in range(steps):
        x = torch.randn(8, 32, generator=gen)
        net(x).square().mean().backward()
        axonn_c.sync_gradients(net)
        opt.step()
        opt.zero_grad(set_to_none=True)


def weights(net):
    return [p.detach().clone() for p in net.parameters()]


def check_checkpoint(directory):
    for grid in ((1, 1, 2, 2), (2, 1, 1, 2), (1, 1, 1, 4)):
        for overlap in (False, True):
            what = f"grid {grid} overlap {overlap}"
            path = os.path.join(directory, f"ckpt_{''.join(map(str, grid))}_{int(overlap)}")
            g = axonn_c.init(*grid, overlap=overlap, compression=INT4)
            try:
                torch.manual_seed(0)
                net = Net()
                opt = torch.optim.SGD(net.parameters(), lr=0.05)
                gen = torch.Generator().manual_seed(7 + g.rank)
                train(net, opt, 3, gen)
                saved = axonn_c.compression_state(net)
                assert sorted(saved["depth"]) == ["l1", "l2"], (what, sorted(saved["depth"]))
                # a dW that no .grad receives (torch.autograd.grad of the input) leaves the
                # training residuals alone
                xin = torch.randn(8, 32, generator=gen, requires_grad=True)
                torch.autograd.grad(net(xin).square().mean(), xin)
                kept = axonn_c.compression_state(net)["depth"]
                assert all(torch.equal(kept[k], saved["depth"][k]) for k in kept), \
                    f"{what}: torch.autograd.grad changed the depth residuals"
                # the round trip restores the same residuals
                axonn_c.load_compression_state(saved, net)
                again = axonn_c.compression_state(net)["depth"]
                assert all(torch.equal(again[k], saved["depth"][k]) for k in saved["depth"])
                ckpt.save(path, net, opt)
                state = gen.get_state()
                train(net, opt, 3, gen)
                after = weights(net)
                # errors: no model, a layer of another shape; nothing changes then
                try:
                    axonn_c.compression_state()
                    raise AssertionError("compression_state() without model did not raise")
                except ValueError as e:
                    assert "pass model=" in str(e), e
                bad = {"residuals": {}, "depth": {"l1": torch.zeros(3)}}
                try:
                    axonn_c.load_compression_state(bad, net)
                    raise AssertionError("a residual of another shape was loaded")
                except ValueError as e:
                    assert "'l1'" in str(e) and "another layer shape or grid" in str(e), e
                # drop every residual, load the checkpoint, train the same steps again
                axonn_c.load_compression_state({"residuals": {}})
                assert axonn_c.compression_state(net)["depth"] == {}
                ckpt.load(path, net, opt)
                back = axonn_c.compression_state(net)["depth"]
                assert sorted(back) == ["l1", "l2"], (what, sorted(back))
                assert all(torch.equal(back[k], saved["depth"][k]) for k in back), what
                gen.set_state(state)
                train(net, opt, 3, gen)
                assert all(torch.equal(a, b) for a, b in zip(weights(net), after)), what
            finally:
                axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print("depth_ef checkpoint: ok", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("identity", "checkpoint"), required=True)
    ap.add_argument("--dir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode == "identity":
        check_identity()
    else:
        check_checkpoint(args.dir)


if __name__ == "__main__":
    main()
