"""Runs AxoNN's own tests, unmodified, against axonn_c's compatibility layer on a CPU machine
(tests/workers/axonn_suite_worker.py launches them under torchrun). Not AxoNN code: the test
files next to it are AxoNN's (see LICENSE and README.md here).

The adaptations, all made here and none in the test files:
- `import axonn` resolves to axonn_c's compatibility modules (axonn_c.axonn.install_import_alias);
- `.cuda()` on a tensor or a module is a no-op when torch has no CUDA (the CPU run);
- `torch.distributed.init_process_group(backend="nccl")` uses gloo when torch was built
  without NCCL (the tests' own _drop/_gather groups only: axonn_c's layers use its shm
  transport), each process group after the first under store keys of its own (gloo would
  otherwise meet its peers at the addresses the destroyed groups left in the store);
- an empty `mpi4py` module when it is not installed (test_intra_layer_conv.py imports it and
  never uses it).
"""
import itertools
import os
import sys
import types

import torch
import torch.distributed as dist

from axonn_c.axonn import install_import_alias

install_import_alias()

if not torch.cuda.is_available():
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self

if not dist.is_nccl_available():
    _init_process_group = dist.init_process_group
    _first_store = []  # the store torchrun's environment gave the first process group
    _inits = itertools.count()

    def _init_without_nccl(backend=None, *args, **kwargs):
        if backend == "nccl":
            backend = "gloo"
        if _first_store and not args and not {"store", "init_method"} & set(kwargs):
            # a process group made again after destroy_process_group(): gloo would meet its
            # peers under the previous groups' store keys (stale addresses), so each new one
            # gets keys of its own
            kwargs.update(store=dist.PrefixStore(f"axonn_suite/{next(_inits)}/",
                                                 _first_store[0]),
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            return _init_process_group(backend, **kwargs)
        out = _init_process_group(backend, *args, **kwargs)
        if not _first_store:
            _first_store.append(dist.distributed_c10d._get_default_store())
        return out

    dist.init_process_group = _init_without_nccl

try:
    import mpi4py  # noqa: F401
except ImportError:
    _mpi4py = types.ModuleType("mpi4py")
    _mpi4py.MPI = types.ModuleType("mpi4py.MPI")
    sys.modules["mpi4py"] = _mpi4py
    sys.modules["mpi4py.MPI"] = _mpi4py.MPI
