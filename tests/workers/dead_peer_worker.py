"""Ranks for the dead-peer tests. The victim (last rank) either sleeps inside the job, so the
test can SIGKILL it mid-collective, or never joins the collective. Survivors must raise."""
import os
import sys
import time

import torch

import axonn_c


def main():
    mode, timeout = sys.argv[1], float(sys.argv[2])
    g = axonn_c.init(G_data=1, G_intra_r=1, G_intra_c=int(os.environ["WORLD_SIZE"]),
                     G_intra_d=1, timeout=timeout)
    x = torch.ones(1 << 20)
    axonn_c.comm.all_reduce(x)  # everyone is alive here
    victim = g.world_size - 1
    if g.rank == victim:
        print("VICTIM READY", flush=True)
        time.sleep(600)  # killed by the test (mode=kill) or simply absent (mode=absent)
        return 0
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            axonn_c.comm.all_reduce(x, group="col")
    except axonn_c.CommError as e:
        elapsed = time.monotonic() - t0
        print(f"RAISED {type(e).__name__} after {elapsed:.2f}s: {e}", flush=True)
        try:  # the communicator stays failed and says so
            axonn_c.comm.all_reduce(x, group="col")
            print("SECOND CALL DID NOT RAISE", flush=True)
        except axonn_c.CommError:
            pass
        axonn_c.finalize()
        return 0
    print("NO ERROR", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
