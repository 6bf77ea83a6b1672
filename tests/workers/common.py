"""Shared by the torchrun workers (each runs as a script, so this directory is on sys.path)."""
import itertools

import torch

GROUPS = ("col", "row", "depth", "data", "intra", "world")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "uint8": torch.uint8}


def grids(world):
    """Every (G_data, G_intra_r, G_intra_c, G_intra_d) whose product is `world`."""
    for gd, gr, gc in itertools.product(range(1, world + 1), repeat=3):
        if world % (gd * gr * gc) == 0:
            yield (world // (gd * gr * gc), gr, gc, gd)
