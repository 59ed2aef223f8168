"""A model's and an optimizer's part of a save walked on the copy thread, not the trainer's.

A plan-cache hit still walked the whole state on the trainer's thread: ``Module.state_dict`` over
every submodule, ``Optimizer.state_dict`` packing every parameter's state, the walk of both, and
each deferred tensor's address: 2.5 µs a tensor, 20 ms at 8,192 tensors. Yet an overlapped save
copies a model's parameters and its optimizer's state on the copy thread, before the optimizer's
next step (which fences it), so they need not be looked at before ``save()`` returns either.

So a full walk records, per module and optimizer of the state (a ``Segment``), its part of the
walk; the next lazy walk (``plan(..., lazy=True)``) splices that part in unchanged if a cheap
check holds, and the copy thread walks the object for real and compares before it copies
(``Segment.check``, from ``plan_cache.Recheck``). What cannot wait is still taken on the trainer's
thread: a module's buffers (forward may change them; re-read by name), an optimizer's
hyperparameters (an LR scheduler may step before the optimizer does), and a check that nothing
was registered on the model since (torch's global registration hooks, ``Watch``) and that the
optimizer holds the same parameter objects, as many states and each parameter's same state dict
(a reloaded optimizer is walked).

Only objects whose state dict is torch's own qualify: no state-dict hooks, no overridden
``_save_to_state_dict`` or ``get_extra_state``, nothing but parameters the copy defers and
persistent buffers in a module's part, no scalars in an optimizer's per-parameter state. A sharded
model (FSDP2) is different: FSDP2 swaps its parameters during forward, so no registration count
tells whether it changed; its FQN state dict is reused while ``sharded_sd`` finds the model
unchanged (checked on the trainer's thread every save), and while it is, walking it again gives the
last walk's part exactly: that part is spliced (``Segment.sharded_model``) and not walked again on
the copy thread. Its optimizers' FQN-keyed state dicts (their per-parameter state is
``opt.state``'s own dicts) are spliced while the model's state dict was not taken anew since
(``StateDicts.takes``), and the copy thread rebuilds them from ``opt.state`` by the FQNs recorded
(``Segment.fqns``). What the copy thread finds changed:
- a tensor laid out anew over the same bytes (reshaped, re-typed): ``Recheck`` lays the slot out
  anew, as for any deferred tensor;
- anything else (a parameter re-pointed with ``.data =``, a buffer added without torch's
  registration, a state-dict hook added): that save fails saying why, and this cache stops
  deferring walks (``PlanCache.deferring``): its later saves walk everything on the trainer's
  thread, as a model that changes under its saves needs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .module_watch import WATCH
from .state import packed_groups

if TYPE_CHECKING:
    from .plan_walk import Walk

_MODULE_STATE_DICT = torch.nn.Module.state_dict
_MODULE_SAVE = torch.nn.Module._save_to_state_dict
_MODULE_EXTRA = torch.nn.Module.get_extra_state
_OPT_STATE_DICT = torch.optim.Optimizer.state_dict


@dataclass(frozen=True)
class Span:
    """Where one object's part sits in a full walk: its tokens, tensors and scalars from
    ``start`` to ``end`` (each a (token, tensor, scalar) index); ``mark``: an optimizer's, where
    its ``param_groups`` part starts."""
    obj: Any
    start: tuple[int, int, int]
    end: tuple[int, int, int]
    mark: tuple[int, int, int] | None


@dataclass(frozen=True)
class Segment:
    """One module's or optimizer's part of the last full walk, spliced into the next lazy walks."""
    obj: Any
    at: int                           # its first tensor's index in the walk
    tokens: list[Any]                 # its whole part (to compare with the copy thread's walk)
    head: list[Any]                   # the tokens spliced: all (module), up to param_groups (optimizer)
    tensors: list[torch.Tensor]
    lazy: list[int]                   # positions (in ``tensors``) the copy defers
    buffers: list[tuple[int, torch.nn.Module, str]]    # a module's other positions: persistent buffers
    generation: int
    groups: list[tuple[list[Any], list[Any]]]          # an optimizer's: (its params, their packed ids)
    states: int                       # an optimizer's: how many parameters have state
    # A sharded model's optimizer: (FQN, parameter) of each entry of its state dict's ``state``, in
    # order; ``generation`` is then the model's ``StateDicts.takes`` it was recorded at. None otherwise.
    fqns: tuple[tuple[str, Any], ...] | None = None
    # An optimizer's: ``opt.state``'s keys (parameters) and values (their state dicts) in order when
    # recorded; a reloaded optimizer (``load_state_dict``: new dicts, new tensors) is walked, not
    # spliced. Compared in order by identity: no parameter hashed (Tensor.__hash__ is Python).
    state_keys: tuple[Any, ...] = ()
    dicts: tuple[Any, ...] = ()
    # The sharded model itself: spliced while its state dict is the one reused this save (its walk is
    # then this part exactly), its ``generation`` the ``StateDicts.takes`` it was recorded at.
    sharded_model: bool = False

    def splice(self, walk: Walk) -> bool:
        """Append this part to ``walk`` if the trainer-side check holds (else append nothing)."""
        obj = self.obj
        if self.sharded_model:
            if not walk.sharded_unchanged(self.generation):
                return False
            walk.tokens += self.head
            walk.tensors += self.tensors
            return True
        if isinstance(obj, torch.nn.Module):
            if WATCH.generation != self.generation:
                return False
            try:
                now = [(i, sub.get_buffer(name)) for i, sub, name in self.buffers]
            except AttributeError:
                return False
            base = len(walk.tensors)
            walk.tokens += self.head
            walk.tensors += self.tensors
            for i, b in now:
                walk.tensors[base + i] = b
            return True
        if (len(obj.state) != self.states or len(obj.param_groups) != len(self.groups)
                or obj._optimizer_state_dict_pre_hooks or obj._optimizer_state_dict_post_hooks
                or (self.fqns is not None and not walk.sharded_unchanged(self.generation))):
            return False
        for g, (params, _) in zip(obj.param_groups, self.groups, strict=True):
            p = g["params"]
            if len(p) != len(params) or not all(map(operator.is_, p, params)):
                return False
        if not (all(map(operator.is_, obj.state, self.state_keys))
                and all(map(operator.is_, obj.state.values(), self.dicts))):
            return False
        walk.tokens += self.head
        walk.tensors += self.tensors
        walk.walk(packed_groups(obj, [idx for _, idx in self.groups]))
        return True

    def state_now(self) -> dict[str, Any] | None:
        """(Copy thread) a sharded model's optimizer's state dict as the walk took it, from
        ``opt.state`` as it is now (KeyError: a parameter lost its state); None: the object's own."""
        if self.fqns is None:
            return None
        opt = self.obj
        state = {}
        for fqn, p in self.fqns:
            s = opt.state.get(p)         # (not opt.state[p]: a defaultdict would add one)
            if s is None:
                raise KeyError(fqn)
            state[fqn] = s
        return {"state": state, "param_groups": packed_groups(opt, [ids for _, ids in self.groups])}

    def same(self, tokens: list[Any]) -> bool:
        """Whether a fresh walk of the object (its tokens after the object's own) has this structure.
        A sharded model's optimizer's parameter addresses (its tokens after the state count) aside:
        the model's state dict holds those parameters themselves, so a local shard that moved is
        copied from where it is (sharded_sd.py, plan_cache.Recheck), and still counts as a
        parameter's storage (what makes a tensor deferrable)."""
        if self.fqns is None or len(tokens) != len(self.tokens):
            return tokens == self.tokens
        n = 1 + sum(len(params) for params, _ in self.groups)
        return tokens[0] == self.tokens[0] and tokens[n:] == self.tokens[n:]


def segments(spans: list[Span], tokens: list[Any], tensors: list[torch.Tensor], scalars: list[Any],
             taken: dict[int, Any], lazy_at: dict[int, int], takes: int | None = None,
             sharded: torch.nn.Module | None = None) -> dict[int, Segment]:
    """The spans of a full walk that qualify (module docstring), by object id. ``takes``: beside a
    sharded model (``sharded``), its ``StateDicts.takes`` now (only it and optimizers qualify)."""
    seen: dict[int, int] = {}
    for s in spans:
        seen[id(s.obj)] = seen.get(id(s.obj), 0) + 1
    out: dict[int, Segment] = {}
    for s in spans:
        if seen[id(s.obj)] > 1:
            continue                 # one object at two places of the state: walked as it is
        (t0, n0, k0), (t1, n1, k1) = s.start, s.end
        lazy = [i - n0 for i in range(n0, n1) if i in lazy_at]
        sd = taken.get(id(s.obj))
        seg: Segment | None = None
        if s.obj is sharded and takes is not None and isinstance(sd, dict) and k1 == k0:
            part = tokens[t0:t1]
            seg = Segment(s.obj, n0, part, part, tensors[n0:n1], lazy, [], takes, [], 0, sharded_model=True)
        elif isinstance(s.obj, torch.nn.Module) and isinstance(sd, dict) and takes is None:
            seg = _module(s.obj, n0, sd, tokens[t0:t1], tensors[n0:n1], lazy, k1 - k0)
        elif isinstance(s.obj, torch.optim.Optimizer) and isinstance(sd, dict) and s.mark is not None:
            mt, mn, mk = s.mark
            if mk == k0 and mn == n1 and len(lazy) == n1 - n0:
                seg = _optimizer(s.obj, n0, sd, tokens[t0:t1], tokens[t0:mt], tensors[n0:n1], lazy, takes)
        if seg is not None:
            out[id(s.obj)] = seg
    return out


def _module(m: torch.nn.Module, at: int, sd: dict[str, Any], tokens: list[Any], tensors: list[torch.Tensor],
            lazy: list[int], scalars: int) -> Segment | None:
    if scalars or type(m).state_dict is not _MODULE_STATE_DICT or len(sd) != len(tensors):
        return None
    subs = list(m.modules())
    for sub in subs:
        cls = type(sub)
        if (cls._save_to_state_dict is not _MODULE_SAVE or cls.get_extra_state is not _MODULE_EXTRA
                or sub._state_dict_hooks or sub._state_dict_pre_hooks):
            return None
    buffers = []
    lazy_set = set(lazy)
    for i, (key, t) in enumerate(zip(sd, tensors, strict=True)):
        if i in lazy_set:
            continue
        prefix, _, name = key.rpartition(".")
        try:
            sub = m.get_submodule(prefix)
            if sub.get_buffer(name) is not t:
                return None
        except AttributeError:
            return None
        buffers.append((i, sub, name))
    WATCH.watch(subs)
    return Segment(m, at, tokens, tokens, tensors, lazy, buffers, WATCH.generation, [], 0)


def _optimizer(opt: torch.optim.Optimizer, at: int, sd: dict[str, Any], tokens: list[Any], head: list[Any],
               tensors: list[torch.Tensor], lazy: list[int], takes: int | None) -> Segment | None:
    if (type(opt).state_dict is not _OPT_STATE_DICT or opt._optimizer_state_dict_pre_hooks
            or opt._optimizer_state_dict_post_hooks):
        return None
    packed = sd.get("param_groups")
    if not isinstance(packed, list) or len(packed) != len(opt.param_groups):
        return None
    groups = [(list(g["params"]), p["params"]) for g, p in zip(opt.param_groups, packed, strict=True)]
    keys, dicts = tuple(opt.state), tuple(opt.state.values())
    if takes is None:
        return Segment(opt, at, tokens, head, tensors, lazy, [], 0, groups, len(opt.state), None, keys, dicts)
    fqns = _fqns(opt, sd.get("state"))
    if fqns is None:
        return None
    return Segment(opt, at, tokens, head, tensors, lazy, [], takes, groups, len(opt.state), fqns, keys, dicts)


def _fqns(opt: torch.optim.Optimizer, state: Any) -> tuple[tuple[str, Any], ...] | None:
    """(FQN, parameter) of each entry of a sharded model's optimizer state dict's ``state``, whose
    values are ``opt.state``'s own dicts (``get_optimizer_state_dict`` hands them out as they are);
    None where one is not, or the entries are not every parameter with state."""
    if not isinstance(state, dict) or len(state) != len(opt.state):
        return None
    param_of = {id(v): p for p, v in opt.state.items()}
    out = []
    for fqn, v in state.items():
        p = param_of.get(id(v))
        if type(fqn) is not str or p is None:
            return None
        out.append((fqn, p))
    return tuple(out)
