"""Shared by the torchrun workers (each runs as a script, so this directory is on sys.path)."""
import itertools

import torch

from axonn_c.state import GROUPS  # noqa: F401 (the workers import it from here)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "uint8": torch.uint8}


class CallCount:
    """How often a counter of the C side (e.g. axonn_c._C.grad_finishes) moved since clear()."""

    def __init__(self, counter):
        self.counter = counter
        self.clear()

    def clear(self):
        self.at = self.counter()

    def __len__(self):
        return self.counter() - self.at


def grids(world):
    """Every (G_data, G_intra_r, G_intra_c, G_intra_d) whose product is `world`."""
    for gd, gr, gc in itertools.product(range(1, world + 1), repeat=3):
        if world % (gd * gr * gc) == 0:
            yield (world // (gd * gr * gc), gr, gc, gd)


def close(got, want, what, tol=1e-5):
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    scale = want.abs().max().item() if want.numel() else 1.0
    if not torch.allclose(got, want, rtol=tol, atol=tol * max(scale, 0.1)):
        raise AssertionError(f"{what}: max |diff| {(got - want).abs().max().item():.3e}")


def train_as_serial(g, ref, par, what, batches, loss_fn, steps, lr):
    """`steps` AdamW steps of the serial model `ref` on the mean of every rank's loss and of the
    parallel `par` on this rank's (sync_gradients(mean=True)): each step's loss equals serial's
    within 1e-4, and at the end full_state_dict(par) equals ref's state dict within 1e-4.
    `batches(step)` gives one input per rank, `loss_fn(model, input)` a scalar loss."""
    import axonn_c  # (here: the other workers import this module before they set up axonn_c)

    opt_r = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt_p = torch.optim.AdamW(par.parameters(), lr=lr)
    for step in range(steps):
        inputs = batches(step)
        losses = [loss_fn(ref, x) for x in inputs]
        (sum(losses) / g.world_size).backward()
        loss = loss_fn(par, inputs[g.rank])
        close(loss, losses[g.rank], f"{what} step {step} loss", 1e-4)
        loss.backward()
        axonn_c.sync_gradients(par, mean=True)
        opt_r.step(), opt_p.step(), opt_r.zero_grad(), opt_p.zero_grad()
    full = axonn_c.full_state_dict(par)
    for k, v in ref.state_dict().items():
        close(full[k], v, f"{what} full_state_dict {k}", 1e-4)


def assert_bytes_equal(stats, pred, what, detail="", unit="bytes", show_counters=False):
    """Every group's counted (bytes_sent, bytes_recv) in `stats` (axonn_c.comm_stats()) equals
    the communication model's `pred` ({"sent": {group: n}, "recv": ...}); the model reports
    exactly GROUPS (a group it adds is compared, not skipped). `what` names the case, `detail`
    ends the message, `show_counters` adds the group's counters to it."""
    if set(pred["sent"]) != set(GROUPS) or set(pred["recv"]) != set(GROUPS):
        raise AssertionError(f"{what}: the model reports groups {sorted(pred['sent'])}, "
                             f"expected {sorted(GROUPS)}")
    for grp in GROUPS:
        got = (stats[grp]["bytes_sent"], stats[grp]["bytes_recv"])
        want = (pred["sent"][grp], pred["recv"][grp])
        if got != want:
            counters = f"; stats {stats[grp]}" if show_counters else ""
            raise AssertionError(f"{what}: group {grp} moved {got} {unit}, the model predicts "
                                 f"{want}{detail}{counters}")
