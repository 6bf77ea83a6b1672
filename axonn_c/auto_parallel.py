"""auto_parallelize(): model code written for torch.nn builds axonn_c layers.

Inside the context, `nn.Linear`, `nn.Conv2d`, transformers' `Conv1D` (and with
`embeddings=True`, `nn.Embedding`) are stand-ins that build the axonn_c layer when its shape
fits the grid and torch's otherwise; what stayed torch's is reported once on rank 0. A weight
assigned to another module inside the context (a tied language-model head) is kept shared.
"""
from __future__ import annotations

import contextlib
import numbers
import warnings
from collections import OrderedDict

import torch
from torch import nn

from .conv import Conv1D, Conv2d
from .embedding import Embedding
from .linear import Linear
from .state import grid, session

__all__ = ["auto_parallelize"]

_TorchLinear = nn.Linear


def _fits_grid(in_features: int, out_features: int, transpose: bool = False) -> bool:
    g = grid()
    g_in, g_out = (g.G_intra_r, g.G_intra_c) if transpose else (g.G_intra_c, g.G_intra_r)
    return in_features % g_in == 0 and out_features % g_out == 0


class _StandInMeta(type(_TorchLinear)):
    """isinstance(x, nn.Linear) (nn.Embedding, nn.Conv2d) inside auto_parallelize() holds for
    both kinds of layer the stand-in builds: a stand-in class names them in `_stands_for` (its
    own, not inherited: a user subclass made inside the context checks as usual)."""

    def __instancecheck__(cls, obj):
        kinds = cls.__dict__.get("_stands_for")
        return isinstance(obj, kinds) if kinds else super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub):
        kinds = cls.__dict__.get("_stands_for")
        return issubclass(sub, kinds) if kinds else super().__subclasscheck__(sub)


class _AutoLinear(_TorchLinear, metaclass=_StandInMeta):
    """Stands for torch.nn.Linear inside auto_parallelize(): `nn.Linear(in, out, ...)` returns an
    axonn_c.Linear when the shapes fit the grid, else a plain torch nn.Linear. Classes that
    subclass nn.Linear inside the context are built normally."""

    _stands_for = (_TorchLinear, Linear)

    def __new__(cls, in_features=None, out_features=None, bias=True, device=None, dtype=None,
                *args, **kwargs):
        if cls is not _AutoLinear:  # a user subclass defined inside the context
            return super().__new__(cls)
        ctx = session.thread.auto
        # (anything but two int sizes: torch's own layer, which accepts or refuses it as serial
        # code sees it)
        if (ctx is None or args or kwargs or not all(
                isinstance(v, numbers.Integral) and not isinstance(v, bool)
                for v in (in_features, out_features))):
            return _TorchLinear(in_features, out_features, bias, device, dtype, *args, **kwargs)
        in_features, out_features, bias = int(in_features), int(out_features), bool(bias)
        if _fits_grid(in_features, out_features):
            try:
                return Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
            except ValueError as err:  # a constraint of the layer beyond divisibility
                ctx["left"].setdefault((in_features, out_features), str(err))
        else:
            ctx["left"].setdefault((in_features, out_features), None)
        return _TorchLinear(in_features, out_features, bias, device=device, dtype=dtype)


_TorchEmbedding = nn.Embedding


class _AutoEmbedding(_TorchEmbedding, metaclass=_StandInMeta):
    """Stands for torch.nn.Embedding inside auto_parallelize(): builds an axonn_c.Embedding (easy
    layout; any vocabulary, padded inside), or torch's layer for what it does not support
    (max_norm, scale_grad_by_freq, sparse), reported with the reason."""

    _stands_for = (_TorchEmbedding, Embedding)

    def __new__(cls, num_embeddings=None, embedding_dim=None, *args, **kwargs):
        if cls is not _AutoEmbedding:  # a user subclass defined inside the context
            return super().__new__(cls)
        ctx = session.thread.auto
        if ctx is not None and ctx["embeddings"]:
            try:
                return Embedding(num_embeddings, embedding_dim, *args, **kwargs)
            except (ValueError, TypeError) as err:
                ctx["left"].setdefault(("Embedding", num_embeddings, embedding_dim), str(err))
        return _TorchEmbedding(num_embeddings, embedding_dim, *args, **kwargs)


_TorchConv2d = nn.Conv2d


class _AutoConv2d(_TorchConv2d, metaclass=_StandInMeta):
    """Stands for torch.nn.Conv2d inside auto_parallelize(): builds an axonn_c.Conv2d (easy
    layout) when it supports the arguments and the channels divide the grid, else torch's layer,
    reported with the reason."""

    _stands_for = (_TorchConv2d, Conv2d)

    def __new__(cls, *args, **kwargs):
        if cls is not _AutoConv2d:  # a user subclass defined inside the context
            return super().__new__(cls)
        ctx = session.thread.auto
        if ctx is not None:
            try:
                return Conv2d(*args, **kwargs)
            except (ValueError, TypeError) as err:
                c_in = args[0] if args else kwargs.get("in_channels")
                c_out = args[1] if len(args) > 1 else kwargs.get("out_channels")
                shape = f"{c_in}x{c_out}"
                ctx["left"].setdefault(("nn.Conv2d", shape), str(err))
        return _TorchConv2d(*args, **kwargs)


def _transformers_conv1d():
    """transformers' Conv1D class when transformers is already imported (GPT-2's projections),
    else None (importing it here would cost seconds for models that do not use it)."""
    import sys
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D as conv1d
    except ImportError:
        return None
    return conv1d


def _conv1d_new(cls, nf=None, nx=None, *args, **kwargs):
    """transformers.Conv1D.__new__ inside auto_parallelize(): `Conv1D(nf, nx)` builds an
    axonn_c.Conv1D when nx divides by the input-feature group and nf by the output-feature
    group, else transformers' layer (reported). (A returned object that is not an instance of
    cls skips cls.__init__.)"""
    ctx = session.thread.auto
    if ctx is not None and cls is ctx["conv1d"] and nf is not None and nx is not None \
            and not args and not kwargs:
        if _fits_grid(int(nx), int(nf)):
            try:
                return Conv1D(nf, nx)
            except ValueError as err:
                ctx["left"].setdefault(("Conv1D", f"{nx}->{nf}"), str(err))
        else:
            ctx["left"].setdefault(("Conv1D", f"{nx}->{nf}"), None)
    return object.__new__(cls)


_CONV1D_NEW = staticmethod(_conv1d_new)


class _TiedLinear(Linear):
    """An axonn_c.Linear output layer whose weight was assigned an axonn_c.Embedding's (a tied
    language-model head): the Embedding's full logits, plus this layer's bias."""

    def forward(self, x):
        y = self._axonn_tied[0].full_logits(x)
        return y if self.bias is None else y + self._full_bias_for_output(self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict = _tied_state(self, state_dict, prefix)
        b = state_dict.get(prefix + "bias")
        if self.bias is not None and b is not None and b.shape[0] == self.out_features:
            with torch.no_grad():
                self.bias.copy_(b[self._block_slices()[0]])
            state_dict[prefix + "bias"] = self.bias
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _TiedTorchLinear(_TorchLinear):
    """The same for a torch nn.Linear output layer (kept because its shapes do not fit)."""

    def forward(self, x):
        y = self._axonn_tied[0].full_logits(x)
        return y if self.bias is None else y + self.bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(_tied_state(self, state_dict, prefix), prefix, *args,
                                      **kwargs)


def _tied_state(layer, state_dict, prefix: str) -> dict:
    """A serial [V, H] weight goes into the tied Embedding; the layer's entry becomes the shard."""
    emb = layer._axonn_tied[0]
    state_dict = dict(state_dict)
    w = state_dict.get(prefix + "weight")
    if w is not None and w.dim() == 2:
        emb.load_full(w)
        state_dict[prefix + "weight"] = emb.weight
    return state_dict


def _describe_layout(layout) -> str:
    if layout is None:
        return "not a layer weight"
    kind, shape, expert, transpose = layout
    return f"a {kind} weight of serial shape {list(shape)}, expert_mode={expert}, " \
           f"transpose={transpose}"


def _tie_on_registration(module, name, param):
    """(auto_parallelize's parameter-registration hook) `head.weight = emb.weight` with an
    axonn_c.Embedding's weight, as transformers' tie_weights does: the head becomes the
    Embedding's output layer, sharing its one sharded weight. Assigning another sharded weight
    (an axonn_c.Linear's, Conv2d's, Conv1D's) is kept as it is when the module is a layer of the
    same shard shape, and refused otherwise: a torch layer would compute with a flat shard."""
    if param is None or session.thread.auto is None:
        return None  # (a parameter being built; another thread, outside the context: unwatched)
    if not hasattr(param, "_axonn_norm_groups"):  # a replicated parameter
        if name == "weight" and type(module) is Linear and tuple(param.shape) == (
                module.out_features, module.in_features):
            _replicate_tied_head(module)  # tied to a replicated table: replicated as well
        return None
    emb = getattr(param, "_axonn_table", None)
    if emb is None:
        old = module._parameters.get(name)
        layout = getattr(param, "_axonn_layout", None)
        if layout is not None and old is not None and name == "weight" and \
                getattr(old, "_axonn_layout", None) == layout:
            return None  # the same layer kind, serial shape and layout: one shard, kept tied
        raise ValueError(
            f"auto_parallelize: cannot tie {type(module).__name__}.{name} to a sharded axonn_c "
            f"parameter ({_describe_layout(layout)}, this rank's flat shard of "
            f"{list(param.shape)}): only the weight of a layer of the same kind, serial shape "
            "and layout (expert_mode, transpose) built inside the context can share it")
    if module is emb or name != "weight":
        return None
    if isinstance(module, Embedding) and (module.num_embeddings, module.embedding_dim,
                                          module.expert_mode) == (emb.num_embeddings,
                                                                  emb.embedding_dim,
                                                                  emb.expert_mode):
        return None  # two tables sharing one weight: the same shards, nothing to change
    kind = {Linear: _TiedLinear, _TorchLinear: _TiedTorchLinear}.get(type(module))
    if kind is None or emb.expert_mode or module.in_features != emb.embedding_dim:
        raise ValueError(
            f"auto_parallelize: cannot tie {type(module).__name__}.weight to an "
            f"axonn_c.Embedding({emb.num_embeddings}, {emb.embedding_dim}"
            f"{', expert_mode=True' if emb.expert_mode else ''}): only an nn.Linear output layer "
            f"with in_features {emb.embedding_dim} (easy layout) can share its weight")
    module.__dict__["_axonn_tied"] = (emb,)
    module.__class__ = kind
    module.out_features = emb.num_embeddings
    return None


# what an nn.Linear instance holds (the rest of an axonn_c.Linear's state is dropped); (not from
# an nn.Linear built here: its initialisation would draw from torch's generator on import)
_TORCH_LINEAR_KEYS = frozenset(nn.Module().__dict__) | {"in_features", "out_features"}


def _replicate_tied_head(layer: Linear) -> None:
    """An axonn_c.Linear whose weight is being assigned a replicated [out, in] parameter (a
    language-model head tied to an embedding that stayed torch's: auto_parallelize() without
    embeddings=True) becomes the torch nn.Linear serial code meant, replicated like the table
    it shares: its bias (if any) gathered whole. (A sharded layer would take the whole table
    for its flat shard.)"""
    bias = layer._parameters.get("bias")
    full = None
    if bias is not None:
        with torch.no_grad():
            full = nn.Parameter(layer._full_bias_for_output(bias).detach().clone(),
                                requires_grad=bias.requires_grad)
    for key in [k for k in layer.__dict__ if k not in _TORCH_LINEAR_KEYS]:
        del layer.__dict__[key]
    layer.__class__ = _TorchLinear
    layer._parameters["bias"] = full


def _report_left(left: "OrderedDict") -> None:
    """One warning (rank 0) naming every layer auto_parallelize kept replicated, and why."""
    g = grid()
    why_not = (f"in_features must divide by G_intra_c={g.G_intra_c} and out_features by "
               f"G_intra_r={g.G_intra_r}")
    kinds = OrderedDict((("Linear", []), ("Embedding", []), ("nn.Conv2d", []), ("Conv1D", [])))
    for key, why in left.items():
        if isinstance(key[0], int):  # an nn.Linear: (in, out)
            kinds["Linear"].append(f"{key[0]}->{key[1]} ({why or why_not})")
        elif key[0] == "Embedding":
            kinds["Embedding"].append(f"{key[1]}x{key[2]} ({why})")
        else:
            kinds[key[0]].append(f"{key[1]} ({why or why_not})")
    names = {"Linear": "torch nn.Linear (not sharded) for in->out",
             "Embedding": "torch nn.Embedding (not sharded) for",
             "nn.Conv2d": "torch nn.Conv2d (not sharded) for in x out channels",
             "Conv1D": "transformers Conv1D (not sharded) for in->out"}
    parts = [f"kept {names[k]} " + "; ".join(v) for k, v in kinds.items() if v]
    if parts:
        warnings.warn("auto_parallelize: " + " | ".join(parts), UserWarning, stacklevel=4)


@contextlib.contextmanager
def auto_parallelize(embeddings: bool = False):
    """Inside this context, `torch.nn.Linear(in, out, bias)` builds an axonn_c.Linear (easy
    layout) when `in` divides by the input-feature group (column) and `out` by the
    output-feature group (row); `torch.nn.Conv2d` an axonn_c.Conv2d (in/out channels likewise,
    groups=1); transformers' `Conv1D(nf, nx)` (GPT-2's projections; when transformers is
    imported) an axonn_c.Conv1D. What stays torch's (other shapes, unsupported arguments) is
    listed with the reason in one warning on rank 0 when the context exits. Requires
    axonn_c.init() first. These layers initialise their full weights exactly like the torch
    layers, so a model built after torch.manual_seed(s) holds the same full weights as the
    serial model built after the same seed (unless the model re-initialises them in place: a
    draw on a shard is not the serial draw; load the serial state dict then).

    `embeddings=True` also makes `nn.Embedding` build an axonn_c.Embedding (easy layout), and
    an output layer whose weight is assigned such an Embedding's weight inside the context
    (`head.weight = emb.weight`, a tied language-model head) shares it (docs/training.md).
    Off by default: a model that re-initialises its embedding in place (`nn.init.normal_(
    emb.weight, std=0.02)`, as GPT-2 does) would draw on each rank's shard, and the layer does
    not run on run_concurrent's micro-batch threads yet. An output layer tied to an embedding
    that stays torch's (the default) stays a replicated torch nn.Linear sharing it. Any other
    assignment of a sharded weight to a module (a tie) is kept when the module is a layer of
    the same shard, else refused (ValueError).

    Inside the context, isinstance(m, nn.Linear) (nn.Conv2d, nn.Embedding) is true for both
    kinds of layer; afterwards torch's classes are back and an axonn_c layer is not an instance
    of them (test for `(nn.Linear, axonn_c.Linear)`). Modules that bound nn.Linear under another
    name before the context (`from torch.nn import Linear`) are not affected; transformers'
    Conv1D is caught under any name (its constructor is patched, not its name).
    """
    grid()  # raises before init()
    import torch.nn.modules.conv as conv_mod
    import torch.nn.modules.linear as linear_mod
    import torch.nn.modules.sparse as sparse_mod

    outer = session.thread.auto
    outer_emb = outer is not None and outer["embeddings"]
    conv1d = _transformers_conv1d()
    ctx = {"left": OrderedDict(), "embeddings": bool(embeddings) or outer_emb, "conv1d": conv1d}
    session.thread.auto = ctx
    saved = (nn.Linear, linear_mod.Linear, nn.Embedding, sparse_mod.Embedding, nn.Conv2d,
             conv_mod.Conv2d)
    nn.Linear = linear_mod.Linear = _AutoLinear
    nn.Conv2d = conv_mod.Conv2d = _AutoConv2d
    if ctx["embeddings"]:
        nn.Embedding = sparse_mod.Embedding = _AutoEmbedding
    tie_hook = None
    if outer is None:
        tie_hook = torch.nn.modules.module.register_module_parameter_registration_hook(
            _tie_on_registration)
    if conv1d is not None and conv1d.__dict__.get("__new__") is not _CONV1D_NEW:
        # installed for good: outside the context it is object.__new__ (deleting an assigned
        # __new__ leaves CPython's object.__new__ refusing the constructor's arguments)
        conv1d.__new__ = _CONV1D_NEW
    try:
        yield
    finally:
        (nn.Linear, linear_mod.Linear, nn.Embedding, sparse_mod.Embedding, nn.Conv2d,
         conv_mod.Conv2d) = saved
        if tie_hook is not None:
            tie_hook.remove()
        session.thread.auto = outer
        if outer is not None:
            for k, v in ctx["left"].items():
                outer["left"].setdefault(k, v)
        elif ctx["left"] and grid().rank == 0:
            _report_left(ctx["left"])

