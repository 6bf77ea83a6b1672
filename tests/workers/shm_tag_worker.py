"""Two ranks of a small job for tests/test_shm_isolation.py. While the job runs, rank 0 plays
another job on the machine (`foreign`: segments with another tag and with none) or leaks a
segment of its own job (`leak`: a name carrying this job's AXONN_C_SHM_TAG). It prints the names
it made, so the test can remove them, and the segment name the ranks met through (read from the
store of the process group it starts first, which axonn_c then uses), so the test can check that
it ends with the tag."""
import os
import sys

import torch
import torch.distributed as dist

import axonn_c


def fake_segment(name):
    """A file in /dev/shm is what shm_open makes; an empty one is enough for a leak check."""
    with open(os.path.join("/dev/shm", name), "w"):
        pass
    print("MADE", name, flush=True)


mode = sys.argv[1]
dist.init_process_group("gloo")
g = axonn_c.init(G_intra_c=int(os.environ["WORLD_SIZE"]), timeout=60)
if g.rank == 1:
    # (the key axonn_c/runtime.py's init sets: its store prefix, then the job's)
    store = dist.PrefixStore("axonn_c/1/", dist.distributed_c10d._get_default_store())
    name = store.get("gen1/shm/name").decode()
    print("SEGMENT", name, flush=True)
x = torch.ones(4)
axonn_c.comm.all_reduce(x, group="col")
assert x.tolist() == [g.world_size] * 4
if g.rank == 0:
    pid = os.getpid()
    if mode == "foreign":
        fake_segment(f"axonn_c.{pid}.990.1")
        fake_segment(f"axonn_c.{pid}.991.1.another-job-{pid}")
        fake_segment(f"axonn_c.{pid}.992.1.{os.environ['AXONN_C_SHM_TAG']}0")  # a prefix only
    else:
        fake_segment(f"axonn_c.{pid}.993.1.{os.environ['AXONN_C_SHM_TAG']}")
axonn_c.comm.barrier()
axonn_c.finalize()
dist.destroy_process_group()
print("shm tag worker done", flush=True)
