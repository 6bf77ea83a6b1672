"""Sharded checkpoints that load on any grid and any world size (docs/checkpoint.md).

A checkpoint is a torch.distributed.checkpoint (DCP) directory. Every tensor is stored in the
serial model's coordinates under the serial model's name: an axonn_c.Linear's weight as the
boxes of the full [out, in] weight that the ranks' depth shards cover (Linear.weight_pieces, no
padding; a Conv2d's boxes of [out, in, kh, kw], a Conv1D's of [in, out]), its bias as the [out]
blocks, every other tensor whole. Each rank writes only its own boxes, one rank per replica;
DCP's resharding intersects the saved boxes with the ones a rank needs on load, so the loading
grid and world size are free.

axonn_c's communicator is not a torch.distributed process group (init() makes none), so this
module drives DCP's planners and file storage itself: the plans, write results and errors are
exchanged as pickled bytes with axonn_c.comm.all_gather over the "world" group. Every step ends
in such an exchange, so an error on one rank raises on every rank (CheckpointError).

    python -m axonn_c.checkpoint info PATH          the grid it was saved on, tensors, sizes
    python -m axonn_c.checkpoint export PATH OUT.pt the serial model's state dict (torch.save)
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import sys
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import comm
from . import compression
from .embedding import Embedding
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .state import grid, session

__all__ = ["save", "load", "SaveHandle", "CheckpointError", "read_info", "export"]

FORMAT = 1  # the layout of the keys below; a checkpoint with another is refused
META_KEY = "axonn_c"  # bytes: format, grid, world size, model keys, torch version
MODEL, OPTIM_STATE, OPTIM_GROUPS, EXTRA = "model.", "optim.state.", "optim.param_groups", "extra"
_EXTRA_STATE = "_extra_state"  # (torch's state dict key of a module's get_extra_state)
# + world rank: that rank's error-feedback residuals of compressed gradient sums and of the
# Linears' depth dW reduce-scatters (by module name), compression.compression_state(model) (per
# rank: each holds its own; restored only on the same grid, where the buckets are the same)
COMPRESSION = "compression.rank"
_PARTIAL, _OLD = ".partial", ".old"  # the save's temporary directory; the replaced checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank, naming the ranks and
    files concerned."""


# ------------------------------------------------------------------ what each rank holds

class _Piece:
    """One tensor of the checkpoint as this rank holds it: the full (serial) shape, the boxes
    of it this rank has (offsets, sizes, view of the local tensor) and whether it writes them
    (one rank per replica does)."""

    __slots__ = ("full", "boxes", "writes")

    def __init__(self, full, boxes, writes):
        self.full, self.boxes, self.writes = tuple(full), boxes, writes


def _sharded(m: nn.Module) -> bool:
    """Whether m's parameters are shards of the serial ones (an axonn_c.Linear, Embedding, or
    a norm split over its hidden group)."""
    return isinstance(m, (Linear, Embedding)) or (isinstance(m, (LayerNorm, RMSNorm))
                                                  and m._split())


def _owners(m: nn.Module):
    """(kind, (layer, kind)) for m's sharded parameters. An output layer tied to an Embedding
    (auto_parallelize: head.weight = emb.weight) holds the Embedding's shard as its weight:
    that weight is the Embedding's; its bias is its own (a Linear's block, else replicated)."""
    tied = m.__dict__.get("_axonn_tied")
    if tied is not None:
        yield "weight", (tied[0], "weight")
        if isinstance(m, Linear) and m.bias is not None:
            yield "bias", (m, "bias")
    elif _sharded(m):
        for kind in ("weight", "bias"):
            if getattr(m, kind, None) is not None:
                yield kind, (m, kind)


def _linear_params(model: nn.Module) -> Dict[int, Tuple[nn.Module, str]]:
    """id(parameter) -> (layer, "weight" | "bias") for the model's sharded layers."""
    out = {}
    for m in model.modules():
        for kind, owner in _owners(m):
            out[id(getattr(m, kind))] = owner
    return out


def _piece(t: Tensor, owner: Optional[Tuple[Linear, str]], g, writer: int = 0) -> _Piece:
    """How `t` (a parameter, or optimizer state shaped like it, when `owner` is its Linear)
    maps to the serial tensor. A replicated tensor is written by world rank `writer` only."""
    if owner is None:
        return _Piece(t.shape, [((0,) * t.dim(), tuple(t.shape), t)], g.rank == writer)
    layer, kind = owner
    flat = t.reshape(-1)
    if isinstance(layer, Embedding):  # (only a weight: depth-sharded like a Linear's)
        boxes = [(off, size, flat[a:b].view(size)) for off, size, a, b in layer.weight_boxes()]
        return _Piece((layer.num_embeddings, layer.embedding_dim), boxes, g.data_rank == 0)
    if isinstance(layer, (LayerNorm, RMSNorm)):  # a block of [hidden] over the hidden group,
        # replicated over depth, data and the plane's other group
        other = g.row_rank if layer.group == "col" else g.col_rank
        start = layer._slice().start
        return _Piece((layer.hidden,), [((start,), (layer.local,), flat)],
                      g.data_rank == 0 and g.depth_rank == 0 and other == 0)
    if kind == "weight":  # (a Conv2d's [out, in, kh, kw], a Conv1D's [in, out])
        return _Piece(layer.serial_weight_shape, layer.weight_pieces(flat), g.data_rank == 0)
    off, n = layer.bias_box()
    # the bias block is replicated over the input group and depth too
    return _Piece((layer.out_features,), [((off,), (n,), flat)],
                  g.data_rank == 0 and g.depth_rank == 0 and layer._shapes["gin_rank"] == 0)


def _is_extra_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == _EXTRA_STATE


def _model_pieces(model: nn.Module, g) -> Tuple["OrderedDict[str, _Piece]", Dict[str, Any]]:
    """(the state dict's tensors as this rank holds them, its extra states that are not tensors:
    saved as rank 0's objects). Replicated parameters (equal on every rank in data-parallel
    training) are written by the ranks in turn; buffers, which may differ between ranks (e.g.
    BatchNorm's running statistics), and extra states as rank 0 holds them."""
    linear = {}  # state dict key -> (layer, "weight" | "bias")
    for name, m in model.named_modules(remove_duplicate=False):
        for kind, owner in _owners(m):
            linear[f"{name}.{kind}" if name else kind] = owner
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    out, objects = OrderedDict(), {}
    for i, (key, t) in enumerate(model.state_dict().items()):
        if not isinstance(t, Tensor):
            if _is_extra_state(key):  # (a module's get_extra_state: any picklable value)
                objects[MODEL + key] = t
                continue
            raise TypeError(f"checkpoint: the model's state dict entry {key!r} is a "
                            f"{type(t).__name__}, not a tensor")
        out[MODEL + key] = _piece(t, linear.get(key), g,
                                  writer=i % g.world_size if key in params else 0)
    return out, objects


def _extra_state_owner(model: nn.Module, key: str) -> nn.Module:
    """The module whose extra state the checkpoint key `model.<name>._extra_state` is."""
    return model.get_submodule(key[len(MODEL):-len(_EXTRA_STATE)].rstrip("."))


def _set_extra_states(model: nn.Module, pieces: Dict[str, _Piece], objects: Dict[str, Any]):
    """Hands each module with extra state what was read for it (set_extra_state, as
    load_state_dict does): a tensor read into the state dict's own (which a module may have made
    for the state dict alone) or an object."""
    for key in [k for k in (*pieces, *objects) if _is_extra_state(k)]:
        value = objects[key] if key in objects else pieces[key].boxes[0][2]
        _extra_state_owner(model, key).set_extra_state(value)


def _param_names(model: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(model: nn.Module, optimizer) -> List[List[Tuple[nn.Parameter, str]]]:
    """The optimizer's parameters per group, with their names in the model."""
    names = _param_names(model)
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"checkpoint: parameter group {gi} of the optimizer holds a "
                                 f"tensor of shape {list(p.shape)} that is not a parameter of "
                                 "the model")
            row.append((p, names[id(p)]))
        groups.append(row)
    return groups


def _optimizer_items(model, optimizer, g):
    """(tensor pieces, objects) of the optimizer: its state per parameter under
    optim.state.<parameter name>.<state name>, mapped through the parameter; the param groups'
    hyperparameters with the parameters' names."""
    linear = _linear_params(model)
    pieces, objects = OrderedDict(), {}
    groups, n_params = [], 0
    for group, params in zip(optimizer.param_groups, _optimizer_params(model, optimizer)):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [name for _, name in params]})
        for p, name in params:
            # (replicated state: the ranks in turn, a parameter's states all from one)
            writer, n_params = n_params % g.world_size, n_params + 1
            for k, v in optimizer.state.get(p, {}).items():
                key = f"{OPTIM_STATE}{name}.{k}"
                if isinstance(v, Tensor) and v.shape == p.shape:
                    pieces[key] = _piece(v.detach(), linear.get(id(p)), g, writer)
                elif isinstance(v, Tensor):
                    pieces[key] = _piece(v.detach(), None, g, writer)
                else:
                    objects[key] = v
    objects[OPTIM_GROUPS] = groups
    return pieces, objects


# ------------------------------------------------------------------ collectives over "world"

def _all_gather_objects(obj) -> list:
    """Every rank's `obj` (pickled), in rank order."""
    data = pickle.dumps(obj)
    world = grid().world_size
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    comm.all_gather(sizes, n, group="world")
    width = int(sizes.max())
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world * width, dtype=torch.uint8)
    comm.all_gather(out, buf, group="world")
    raw = out.numpy().tobytes()
    return [pickle.loads(raw[r * width: r * width + int(sizes[r])]) for r in range(world)]


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _agree(what: str, fn: Callable[[], Any] = None, share: bool = False):
    """Runs fn on this rank, then tells every rank whether it failed anywhere: raises
    CheckpointError on every rank naming each failed rank's error. Returns fn's value (with
    share=True, every rank's value in rank order)."""
    value, err = None, None
    try:
        value = fn() if fn is not None else None
    except Exception as e:  # noqa: BLE001 (reported to every rank below)
        err = _describe(e)
    replies = _all_gather_objects((err, value if share else None))
    by_error: Dict[str, List[int]] = {}  # the same error on many ranks is named once
    for r, (e, _) in enumerate(replies):
        if e is not None:
            by_error.setdefault(e, []).append(r)
    if by_error:
        n = sum(len(v) for v in by_error.values())
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} "
                           f"{', '.join(map(str, rs[:8]))}{'...' if len(rs) > 8 else ''}: {e}"
                           for e, rs in list(by_error.items())[:8])
        raise CheckpointError(f"checkpoint {what} failed on {n} of {len(replies)} ranks: "
                              f"{detail}")
    return [v for _, v in replies] if share else value


# ------------------------------------------------------------------ DCP planners

class _SavePlanner(DefaultSavePlanner):
    """Writes the given boxes and objects (no state dict traversal): the boxes are views of the
    shards; objects are pickled when the planner is made (a later change is not saved)."""

    def __init__(self, pieces: Dict[str, _Piece], objects: Dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors: Dict[Tuple[str, tuple], Tensor] = {}
        self._bytes: Dict[str, bytes] = {}
        self._items: List[WriteItem] = []
        for fqn, pc in pieces.items():
            if not pc.writes:
                continue
            for off, size, view in pc.boxes:
                self._tensors[(fqn, tuple(off))] = view
                self._items.append(WriteItem(
                    index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                   sizes=torch.Size(size)),
                        properties=TensorProperties.create_from_tensor(view),
                        size=torch.Size(pc.full))))
        for fqn, obj in objects.items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            self._bytes[fqn] = buf.getvalue()
            self._items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def stage(self) -> None:
        """Copies the boxes to fresh CPU tensors (an asynchronous save writes those while
        training changes the parameters)."""
        self._tensors = {k: v.detach().to("cpu", copy=True) for k, v in self._tensors.items()}

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return io.BytesIO(self._bytes[index.fqn])
        return self._tensors[(index.fqn, tuple(index.offset))]

    def transform_object(self, write_item: WriteItem, object: Any):
        return object  # (BYTE_IO objects are pickled already)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into the given boxes (views of this rank's shards) and objects by name."""

    def __init__(self, targets: Dict[str, List[Tuple[tuple, tuple, Tensor]]], objects: List[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets, self._object_keys, self.objects = targets, objects, {}

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, boxes in self._targets.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                      for o, s, _ in boxes]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn],
                                                      chunks)
        for fqn in self._object_keys:
            idx = MetadataIndex(fqn)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx,
                                  dest_offsets=torch.Size((0,)), storage_index=idx,
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self._targets[index.fqn][index.index][2]


# ------------------------------------------------------------------ reading

def _read_metadata(path: str) -> Tuple[FileSystemReader, Metadata, dict]:
    """(reader, DCP metadata, axonn_c's own record) of the checkpoint at `path`; raises
    naming the file and what is wrong with it."""
    if not os.path.exists(path):
        hint = ""
        if os.path.isdir(path + _OLD):
            hint = (f" (a save to it was interrupted while replacing it: the previous checkpoint "
                    f"is {path + _OLD})")
        elif os.path.isdir(path + _PARTIAL):
            hint = f" (only the unfinished save {path + _PARTIAL}, which is not loadable)"
        raise FileNotFoundError(f"no checkpoint at {path}{hint}")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a checkpoint directory (axonn_c.checkpoint.save "
                         "writes a directory)")
    md_file = os.path.join(path, ".metadata")
    if not os.path.isfile(md_file):
        raise ValueError(f"{md_file} is missing: {path} is not a finished DCP checkpoint")
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 (any unpickling error: a truncated or foreign file)
        raise ValueError(f"{md_file} is truncated or not DCP metadata ({_describe(e)})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{md_file} is not DCP metadata (holds a {type(metadata).__name__})")
    if not isinstance(metadata.state_dict_metadata.get(META_KEY), BytesStorageMetadata):
        raise ValueError(f"{path} is a DCP checkpoint not written by axonn_c.checkpoint.save "
                         f"(no '{META_KEY}' record)")
    reader.set_up_storage_reader(metadata, True)
    info = _read_local(reader, metadata, path, {}, [META_KEY])[META_KEY]
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{path} has axonn_c checkpoint format "
                         f"{info.get('format') if isinstance(info, dict) else info!r}; this "
                         f"version reads format {FORMAT}")
    return reader, metadata, info


def _check_files(plan: LoadPlan, metadata: Metadata, path: str) -> None:
    """Every file the plan reads exists and is long enough (a clear error instead of
    torch.load's on a truncated file)."""
    sizes: Dict[str, int] = {}
    for item in plan.items:
        info = metadata.storage_data.get(item.storage_index)
        if info is None:
            raise ValueError(f"{path}/.metadata lists no storage for {item.storage_index.fqn}")
        f = os.path.join(path, info.relative_path)
        if f not in sizes:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"{f} is missing (the checkpoint's metadata lists it)")
            sizes[f] = os.path.getsize(f)
        if sizes[f] < info.offset + info.length:
            raise ValueError(f"{f} is truncated: {sizes[f]} bytes, but "
                             f"{item.storage_index.fqn} is stored at bytes {info.offset}.."
                             f"{info.offset + info.length}")


def _read_local(reader, metadata, path, targets, object_keys) -> dict:
    """Reads the boxes of `targets` and the objects named in `object_keys` on this rank
    alone; returns the objects."""
    planner = _LoadPlanner(targets, object_keys)
    planner.set_up_planner(None, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    _check_files(plan, metadata, path)
    files = sorted({metadata.storage_data[i.storage_index].relative_path for i in plan.items})
    try:
        reader.read_data(plan, planner).wait()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"reading {', '.join(os.path.join(path, f) for f in files)} failed "
                         f"({_describe(e)})") from e
    return planner.objects


def _tensor_md(metadata: Metadata, key: str) -> Optional[TensorStorageMetadata]:
    md = metadata.state_dict_metadata.get(key)
    return md if isinstance(md, TensorStorageMetadata) else None


def _check_model(model: nn.Module, pieces: Dict[str, _Piece], extra_objects: Dict[str, Any],
                 metadata: Metadata, path: str) -> None:
    """Raises unless the checkpoint holds every tensor of the model in its shape (and every
    extra state that is not a tensor as an object), and nothing else of a model."""
    saved = {k for k in metadata.state_dict_metadata if k.startswith(MODEL)}
    for k in [k for k in (*pieces, *extra_objects) if k not in saved and _is_extra_state(k)]:
        # extra state that a checkpoint written before its module had any lacks: a module that
        # says it may be missing (axonn_c.models.GPT's dropout counter) keeps its own
        if getattr(_extra_state_owner(model, k), "_axonn_optional_extra_state", False):
            pieces.pop(k, None)
            extra_objects.pop(k, None)
    missing = [k[len(MODEL):] for k in (*pieces, *extra_objects) if k not in saved]
    unexpected = sorted(k[len(MODEL):] for k in saved - set(pieces) - set(extra_objects))
    shapes = [f"{k[len(MODEL):]}: a tensor in the checkpoint, not in the model"
              for k in extra_objects if _tensor_md(metadata, k) is not None]
    for k, pc in pieces.items():
        md = _tensor_md(metadata, k)
        if md is None and k in saved:
            shapes.append(f"{k[len(MODEL):]}: not a tensor in the checkpoint")
        elif md is not None and tuple(md.size) != pc.full:
            shapes.append(f"{k[len(MODEL):]}: checkpoint {list(md.size)}, model {list(pc.full)}")
    if missing or unexpected or shapes:
        def few(xs):
            return ", ".join(xs[:20]) + (f" (and {len(xs) - 20} more)" if len(xs) > 20 else "")
        parts = ([f"missing keys (in the model, not in the checkpoint): {few(missing)}"]
                 if missing else [])
        parts += ([f"unexpected keys (in the checkpoint, not in the model): {few(unexpected)}"]
                  if unexpected else [])
        parts += [f"other shapes: {few(shapes)}"] if shapes else []
        raise ValueError(f"the model does not match the checkpoint {path}: " + "; ".join(parts))


def _optimizer_targets(model, optimizer, metadata, g):
    """Tensors to read the optimizer's saved state into, per parameter: {param: {state name:
    tensor}}, plus the boxes to read and the object keys."""
    linear = _linear_params(model)
    saved: Dict[str, List[Tuple[str, Any]]] = {}  # parameter name -> [(state name, metadata)]
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(OPTIM_STATE):  # optim.state.<parameter name>.<state name>
            name, k = key[len(OPTIM_STATE):].rsplit(".", 1)
            saved.setdefault(name, []).append((k, md))
    dest: Dict[int, Dict[str, Any]] = {}
    targets, object_keys = {}, [OPTIM_GROUPS]
    for params in _optimizer_params(model, optimizer):
        for p, name in params:
            st = dest.setdefault(id(p), {})
            owner = linear.get(id(p))
            full = _piece(p.detach(), owner, g).full
            for k, md in saved.get(name, []):
                key = f"{OPTIM_STATE}{name}.{k}"
                if isinstance(md, BytesStorageMetadata):
                    object_keys.append(key)
                    st[k] = key  # filled in from the objects read
                    continue
                if owner is not None and tuple(md.size) == full:
                    # the padding of the last depth shard is not saved: zeros, as in training
                    t = torch.zeros(p.shape, dtype=md.properties.dtype)
                    pc = _piece(t, owner, g)
                else:
                    t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                    pc = _piece(t, None, g)
                st[k] = t
                if pc.boxes:
                    targets[key] = pc.boxes
    return dest, targets, object_keys


def _optimizer_state_dict(model, optimizer, dest, objects, path, kind) -> dict:
    """The optimizer's state dict (torch's format) from what was read (kind: the saved
    optimizer's class name, or None)."""
    saved_groups = objects[OPTIM_GROUPS]
    params = _optimizer_params(model, optimizer)
    if len(saved_groups) != len(params):
        raise ValueError(f"the checkpoint {path} has {len(saved_groups)} optimizer parameter "
                         f"groups, the optimizer {len(params)}")
    state, groups, index = {}, [], 0
    for gi, (saved, current) in enumerate(zip(saved_groups, params)):
        names = [name for _, name in current]
        # another optimizer's state (its step would fail on what it lacks later); the same
        # class may lack what a newer torch or an LR scheduler adds, which torch fills in
        lacks = sorted(set(optimizer.param_groups[gi]) - set(saved))
        if lacks and kind and kind != type(optimizer).__name__:
            raise ValueError(f"the checkpoint {path} holds the state of an optimizer of class "
                             f"{kind}, whose parameter group {gi} lacks this "
                             f"{type(optimizer).__name__}'s hyperparameters {', '.join(lacks)}")
        if saved["params"] != names:
            diff = sorted(set(saved["params"]) ^ set(names))
            raise ValueError(f"optimizer parameter group {gi} holds other parameters than in the "
                             f"checkpoint {path}" + (f": {', '.join(diff[:20])}" if diff else
                                                     " (another order)"))
        ids = []
        for p, _ in current:
            st = {k: (objects[v] if isinstance(v, str) else v) for k, v in dest[id(p)].items()}
            if st:
                state[index] = st
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------ save

def _check_target(path: str) -> None:
    """A save replaces `path` only when it is a checkpoint (or an empty directory)."""
    if os.path.isdir(path):
        if os.listdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileExistsError(f"{path} exists and is not a checkpoint: refusing to replace "
                                  "it")
    elif os.path.exists(path):
        raise FileExistsError(f"{path} exists and is a file, not a checkpoint directory")


def _remove(p: str) -> None:
    """Removes `p`: a link or a file itself (never what a link points to), a directory with
    everything in it."""
    if os.path.islink(p) or os.path.isfile(p):
        os.unlink(p)
    elif os.path.isdir(p):
        shutil.rmtree(p)


def _fresh_dir(d: str) -> None:
    _remove(d)
    os.makedirs(d)


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, path: str) -> None:
    """Makes the finished `tmp` the checkpoint at `path` (rank 0). A new path is one rename;
    an existing checkpoint is moved aside first and removed last, so a kill in between leaves
    one of the two complete (load names PATH.old when PATH is missing). A link at `path` is
    replaced itself: what it pointed to is kept."""
    parent = os.path.dirname(os.path.abspath(path))
    old = path + _OLD
    _fsync_dir(tmp)  # (its entries, .metadata's rename included, before it becomes PATH)
    if os.path.lexists(path):
        _remove(old)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    try:
        _remove(old)
    except OSError as e:  # (published already: the save succeeded)
        warnings.warn(f"checkpoint: published {path}, but the previous one moved to {old} "
                      f"could not be removed ({e})", RuntimeWarning, stacklevel=2)


def _discard(tmp: str) -> None:
    """Rank 0, after a save failed on every rank (all writes ended): its unfinished directory
    goes (a failure to remove it is not the save's error)."""
    if grid().rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


class SaveHandle:
    """An asynchronous save in flight (save(..., async_save=True)): wait() (collective, on
    every rank) waits for this rank's writes, then publishes the checkpoint once every rank
    finished. The next save() or load() waits for it."""

    def __init__(self, path: str, finish: Callable[[], None], thread: threading.Thread):
        self.path, self._finish, self._thread, self._done = path, finish, thread, False
        self._error: Optional[CheckpointError] = None  # why it was not published
        self._epoch = session.epoch  # its collectives need this init()'s communicator

    def done(self) -> bool:
        """True once wait() returned the path: the checkpoint is published."""
        return self._done

    def failed(self) -> bool:
        """True once wait() raised: the checkpoint was not published (wait() raises again)."""
        return self._error is not None

    def stale(self) -> bool:
        """True when finalize() (or another init()) ran before wait(): it can no longer be
        published."""
        return not self._done and self._error is None and self._epoch != session.epoch

    def wait(self) -> str:
        """Collective: joins the writes, publishes; returns the checkpoint's path. Raises
        CheckpointError when the save failed (again on every later call)."""
        if self._error is not None:
            raise self._error
        if not self._done:
            self._thread.join()
            stale = self.stale()
            try:
                if stale:
                    raise CheckpointError(
                        f"the asynchronous save to {self.path} was not published: finalize() or "
                        f"init() ran before its wait() ({self.path}{_PARTIAL} is left "
                        "unfinished)")
                self._finish()
                self._done = True
            except CheckpointError as e:
                self._error = e
                raise
            finally:
                if session.checkpoint_pending is self:
                    session.checkpoint_pending = None
        return self.path


def _join_pending() -> None:
    h = session.checkpoint_pending
    if h is not None and h.stale():  # (from before a finalize(): dropped, with a warning)
        try:
            h.wait()
        except CheckpointError as e:
            warnings.warn(str(e), RuntimeWarning, stacklevel=3)
    elif h is not None:
        h.wait()


def save(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[dict] = None, async_save: bool = False):
    """Saves `model` (and `optimizer`, and the picklable `extra`) as a DCP checkpoint directory
    at `path`; collective (every rank calls it). Each rank writes only its own shards. The
    directory appears only once complete: it is written as PATH.partial and renamed; an
    existing checkpoint at `path` is replaced. `extra` is saved as rank 0 holds it.

    async_save=True: the shards are copied (to CPU) and planned now, written by a background
    thread; returns a SaveHandle whose wait() (collective) publishes the checkpoint. The next
    save or load waits for it. Otherwise returns the path once the checkpoint is published."""
    _join_pending()
    g = grid()  # raises before init()
    path = os.path.normpath(os.fspath(path))  # ("ckpt/": PATH.partial beside it, not in it)
    tmp = path + _PARTIAL
    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpoint.save: model must be an nn.Module, got {type(model).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"checkpoint.save: extra must be a dict or None, got "
                        f"{type(extra).__name__}")

    def prepare():
        if g.rank == 0:
            _check_target(path)
            _fresh_dir(tmp)
    _agree(f"save to {path} (preparing {tmp})", prepare)

    def plan():
        pieces, extra_objects = _model_pieces(model, g)
        objects = {**extra_objects, META_KEY: {"format": FORMAT, "world_size": g.world_size,
                              "grid": {"G_data": g.G_data, "G_intra_r": g.G_intra_r,
                                       "G_intra_c": g.G_intra_c, "G_intra_d": g.G_intra_d},
                              "model_keys": [k[len(MODEL):] for k in pieces],
                              # (extra states that are not tensors, saved as objects)
                              "model_objects": [k[len(MODEL):] for k in extra_objects],
                              "optimizer": type(optimizer).__name__ if optimizer else None,
                              "torch": torch.__version__, "time": time.time()}}
        if optimizer is not None:
            opt_pieces, opt_objects = _optimizer_items(model, optimizer, g)
            pieces.update(opt_pieces)
            objects.update(opt_objects)
        if extra is not None:
            objects[EXTRA] = extra
        if g.rank != 0:
            objects = {}
        residuals = compression.compression_state(model)
        if residuals["residuals"] or residuals["depth"]:
            objects[f"{COMPRESSION}{g.rank}"] = residuals
        planner = _SavePlanner(pieces, objects)
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                  overwrite=True)
        writer.set_up_storage_writer(g.rank == 0, rank=g.rank, use_collectives=True)
        planner.set_up_planner(None, writer.storage_meta(), g.rank == 0)
        return planner, writer, writer.prepare_local_plan(planner.create_local_plan())

    try:
        return _save_prepared(path, tmp, g, plan, async_save)
    except CheckpointError:  # (raised on every rank: no rank writes any more)
        _discard(tmp)
        raise


def _save_prepared(path: str, tmp: str, g, plan: Callable, async_save: bool):
    """save() once PATH.partial exists: plan, write, publish (or hand the writes to a thread)."""
    planner, writer, local_plan = _agree(f"save to {path} (planning)", plan)
    all_plans = _agree(f"save to {path} (planning)", lambda: local_plan, share=True)

    def global_plan():
        # the same deterministic global plan on every rank (DCP computes it on a coordinator
        # and scatters it; here every rank has every local plan already)
        plans, metadata = planner.create_global_plan(all_plans)
        plans = writer.prepare_global_plan(plans)
        return planner.finish_plan(plans[g.rank]), metadata

    my_plan, metadata = _agree(f"save to {path} (global plan)", global_plan)
    box: Dict[str, Any] = {}

    def write():
        try:
            box["results"] = writer.write_data(my_plan, planner).value()
        except Exception as e:  # noqa: BLE001 (reported to every rank by finish)
            box["error"] = f"writing {tmp} failed ({_describe(e)})"

    def finish():
        try:
            publish_results()
        except CheckpointError:
            _discard(tmp)
            raise

    def publish_results():
        def results():
            if "error" in box:
                raise RuntimeError(box["error"])
            return box["results"]
        all_results = _agree(f"save to {path} (writing)", results, share=True)

        def publish():
            if g.rank == 0:
                writer.finish(metadata, all_results)
                _publish(tmp, path)
        _agree(f"save to {path} (publishing)", publish)

    if not async_save:
        write()
        publish_results()
        return path
    _agree(f"save to {path} (copying the shards)", planner.stage)
    thread = threading.Thread(target=write, name="axonn_c-checkpoint-save", daemon=True)
    thread.start()
    handle = SaveHandle(path, finish, thread)
    session.checkpoint_pending = handle
    return handle


# ------------------------------------------------------------------ load

def load(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
    """Loads a checkpoint written by save() into `model` (and `optimizer`) on the current grid,
    whatever grid and world size it was saved on; collective. Each rank reads only the boxes
    its shards need. Returns the saved `extra` (None if none was saved).

    Raises CheckpointError on every rank when the checkpoint is missing, truncated, foreign or
    does not match the model (naming the missing and unexpected keys and other shapes); the
    model may then be partly loaded."""
    _join_pending()
    g = grid()  # raises before init()
    path = os.path.normpath(os.fspath(path))
    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpoint.load: model must be an nn.Module, got {type(model).__name__}")
    reader, metadata, info = _agree(f"load of {path}", lambda: _read_metadata(path))
    own_residuals = f"{COMPRESSION}{g.rank}"
    same_grid = info.get("world_size") == g.world_size and info.get("grid") == {
        "G_data": g.G_data, "G_intra_r": g.G_intra_r, "G_intra_c": g.G_intra_c,
        "G_intra_d": g.G_intra_d}

    def plan():
        pieces, extra_objects = _model_pieces(model, g)
        _check_model(model, pieces, extra_objects, metadata, path)
        targets = {k: pc.boxes for k, pc in pieces.items() if pc.boxes}
        object_keys = [EXTRA] if EXTRA in metadata.state_dict_metadata else []
        object_keys += list(extra_objects)
        if same_grid and own_residuals in metadata.state_dict_metadata:
            object_keys.append(own_residuals)
        dest = None
        if optimizer is not None:
            if OPTIM_GROUPS not in metadata.state_dict_metadata:
                raise ValueError(f"the checkpoint {path} holds no optimizer state")
            dest, opt_targets, opt_keys = _optimizer_targets(model, optimizer, metadata, g)
            targets.update(opt_targets)
            object_keys += opt_keys
        return pieces, targets, object_keys, dest

    pieces, targets, object_keys, dest = _agree(f"load of {path} (matching the model)", plan)
    with torch.no_grad():
        objects = _agree(f"load of {path} (reading)",
                         lambda: _read_local(reader, metadata, path, targets, object_keys))
        _agree(f"load of {path} (extra states)",
               lambda: _set_extra_states(model, pieces, objects))
    if optimizer is not None:
        _agree(f"load of {path} (optimizer state)", lambda: optimizer.load_state_dict(
            _optimizer_state_dict(model, optimizer, dest, objects, path, info.get("optimizer"))))
    # the checkpoint's residuals on its grid; none otherwise (another grid's buckets differ, and
    # those held now belong to steps after the checkpoint's)
    _agree(f"load of {path} (compression residuals)", lambda: compression.load_compression_state(
        objects.get(own_residuals, {"residuals": {}, "depth": {}}), model))
    return objects.get(EXTRA)


# ------------------------------------------------------------------ offline tools

def read_info(path) -> dict:
    """What `info` prints, as a dict (no init() needed): axonn_c's record (grid, world size,
    model keys) and {key: (shape, dtype, number of boxes)} of the tensors."""
    path = os.path.normpath(os.fspath(path))
    _, metadata, info = _read_metadata(path)
    tensors = {k: (tuple(md.size), md.properties.dtype, len(md.chunks))
               for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    objects = sorted(k for k, md in metadata.state_dict_metadata.items()
                     if isinstance(md, BytesStorageMetadata) and k != META_KEY)
    return {**info, "tensors": tensors, "objects": objects}


def export(path, out=None) -> "OrderedDict[str, Tensor]":
    """The serial model's state dict from the checkpoint at `path` (no init() needed): full
    tensors under the serial names, loadable by the plain model's load_state_dict. Written with
    torch.save to `out` when given."""
    path = os.path.normpath(os.fspath(path))
    reader, metadata, info = _read_metadata(path)
    full = OrderedDict()
    for key in info["model_keys"]:
        md = _tensor_md(metadata, MODEL + key)
        if md is None:
            raise ValueError(f"{path}: model key {key} has no tensor in the checkpoint")
        full[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    targets = {MODEL + k: [((0,) * t.dim(), tuple(t.shape), t)] for k, t in full.items()
               if t.numel()}
    extras = info.get("model_objects", [])  # (extra states that are not tensors)
    objects = _read_local(reader, metadata, path, targets, [MODEL + k for k in extras])
    full.update((k, objects[MODEL + k]) for k in extras)
    if out is not None:
        torch.save(full, out)
    return full


def _print_info(path: str) -> None:
    info = read_info(path)
    grid_s = " ".join(f"{k}={v}" for k, v in info["grid"].items())
    print(f"{path}: axonn_c checkpoint format {info['format']}, saved on {info['world_size']} "
          f"ranks ({grid_s}) with torch {info['torch']}, at "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(info['time']))} UTC")
    print(f"optimizer: {info['optimizer']}")
    total = 0
    for k, (shape, dtype, chunks) in info["tensors"].items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total += n
        print(f"  {k:60s} {str(list(shape)):>16s} {str(dtype)[6:]:>9s} {n / 2**20:10.3f} MiB"
              f"  {chunks} box{'es' if chunks != 1 else ''}")
    print(f"objects: {', '.join(info['objects']) or '-'}")
    print(f"{len(info['tensors'])} tensors, {total / 2**20:.3f} MiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m axonn_c.checkpoint",
                                 description="Inspect or export an axonn_c checkpoint.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="the grid it was saved on, its tensors and sizes")
    p.add_argument("path")
    p = sub.add_parser("export", help="write the serial model's state dict with torch.save")
    p.add_argument("path")
    p.add_argument("out")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "info":
            _print_info(args.path)
        else:
            sd = export(args.path, args.out)
            print(f"wrote {args.out}: {len(sd)} tensors of the serial model")
    except (OSError, ValueError, RuntimeError) as e:  # (torch.save: RuntimeError)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
