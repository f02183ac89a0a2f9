"""int8 codes in a state_dict (docs/design.md §8), marked so that they are never read as values.

`torch.distributed.checkpoint` loads a checkpoint into the keys and dtypes of the state_dict it
is given, the loading optimizer's: a checkpoint of int8 state read through the state_dict of
an optimizer with float state fills its float buffers with the codes cast to floats (127.0),
and the next step would take them for momenta. load_state_dict refuses a buffer saved
holding codes that comes as floats. Per buffer: a group switched to int8 converts a
parameter's state at its next step, so one group may hold codes and float state side by side
(and a buffer given float data by hand, codes beside it).

Two marks say which buffers hold codes, as torch's state_dict utilities carry one or the other:
- Each saved entry's KEY (a bit a buffer, in BUFFERS' order; an int64 tensor, 0 for none):
  DCP keys the state by parameter name, and a loading optimizer may list the same
  parameters in another order or in other groups, so the mark goes with its parameter. In
  every entry: DCP reads from a checkpoint only the keys the loading optimizer's own
  state_dict has, and it is the optimizer with float state that must ask for it. A tensor:
  carried by parameter as the step counter is (every rank alike with broadcast_from_rank0),
  and taken by torch.load(weights_only=True). Where any entry says codes, the entries alone
  decide.
- Each saved group's KEY ("0:exp_avg,2:exp_avg": places in its params and buffers), for
  flatten_optimizer_state_dict=True, which rebuilds the loaded entries from the keys of the
  loading optimizer's live state (so it drops the entry's mark) and the loaded groups from
  its live groups' keys: every live group holds KEY too (None), and the places are one
  string, as those utilities flatten a list into a key per element. Positional: in that
  layout a loading optimizer listing the parameters in other groups or another order than
  the saved one is not checked aright (docs/design.md §8).
The refusal does not ask whether scales came too: with broadcast_from_rank0, rank 0's entries
get the checkpoint's keys the loading optimizer lacks (its scales), the other ranks' do not,
and every rank must refuse alike.

DCP writes into the tensors of the state_dict it is given, which are the loading optimizer's
own state (`dcp.load(get_optimizer_state_dict(...))`): by the time load_state_dict refuses,
those buffers hold the codes as values, and the other entries the checkpoint's values beside
groups never loaded. Each entry so written is marked (REFUSED_LOAD), and a step refuses it,
naming it, until it is deleted or a state_dict loads (the mark stays out of state_dict(), so
that DCP's next load does not ask a checkpoint for it)."""
import torch

from .params import local
from .quantization import SIGNED, scale_name
from .state import CODE_DTYPES, REFUSED_LOAD

# The key of each saved state entry and of each group: where its state holds int8 codes.
KEY = "saved_int8_codes"
BUFFERS = tuple(SIGNED)  # bit i of an entry's KEY: BUFFERS[i] holds codes


def hold_key(groups) -> None:
    """Gives each live group KEY (None) where it has none: a group added by hand too."""
    for group in groups:
        group.setdefault(KEY, None)


def hold_key_pre_hook(optimizer) -> None:
    """state_dict pre-hook: DCP's flattened load reads the loading optimizer's group keys."""
    hold_key(optimizer.param_groups)


def mark(optimizer, state_dict) -> None:
    """state_dict post-hook: each saved entry's and group's KEY (a buffer given float data by
    hand beside another's codes is no buffer of codes). Entries copied: they may be the
    optimizer's own."""
    state, saved_state = optimizer.state, state_dict["state"]
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        places = []
        for i, (p, index) in enumerate(zip(group["params"], saved["params"])):
            names = _code_buffers(state.get(p))
            places += [f"{i}:{name}" for name in names]
            entry = saved_state.get(index)
            if isinstance(entry, dict):
                bits = sum(1 << BUFFERS.index(name) for name in names)
                saved_state[index] = {**entry, KEY: torch.tensor(bits, dtype=torch.int64)}
        saved[KEY] = ",".join(places)


def _code_buffers(entry) -> list:
    return [name for name in entry or () if name in SIGNED and _is_codes(entry[name])
            and torch.is_tensor(entry.get(scale_name(name)))]


def _is_codes(value) -> bool:
    return torch.is_tensor(value) and value.dtype in CODE_DTYPES


def _marked(entry) -> list:
    """The buffers a saved entry's KEY says hold codes (cast to a float by a converter too)."""
    bits = entry.get(KEY)
    if not (torch.is_tensor(bits) and bits.numel() == 1 and not local(bits).is_meta):
        return []
    value = float(local(bits).reshape(()).item())
    if not (0 <= value < 2 ** len(BUFFERS) and value == int(value)):
        return []
    return [name for i, name in enumerate(BUFFERS) if int(value) >> i & 1]


def _places(saved) -> list:
    """A saved group's KEY as (place, buffer or None: any) pairs, from "0:exp_avg,2:exp_avg"
    (or the list of places an earlier version saved)."""
    value = saved.get(KEY)
    if not isinstance(value, str):
        return [(item, None) for item in value or [] if isinstance(item, int) and item >= 0]
    pairs = [item.partition(":") for item in value.split(",")]
    return [(int(place), name) for place, _, name in pairs if place.isdigit() and name]


def refuse_codes_read_as_values(optimizer, state_dict: dict) -> dict:
    """Raises, naming the first, where buffers saved holding codes come holding floats
    (marking each of the optimizer's own entries the load had written into, where it loaded
    into the optimizer's own tensors); returns the state_dict without the marks (no state
    and no hyper-parameter)."""
    state = state_dict.get("state", {})
    saved_groups = state_dict.get("param_groups", [])
    marked = {index: [(name, KEY) for name in _marked(entry)]
              for index, entry in state.items() if isinstance(entry, dict)}
    marked = {index: names for index, names in marked.items() if names}
    # The groups' places where no entry says codes: the flattened layout (entries without
    # the mark), or a DCP checkpoint saved before it read with allow_partial_load (entries
    # holding the loading optimizer's own marks, none for float state).
    for gi, saved in enumerate(saved_groups if not marked else []):
        ids = saved.get("params", [])
        for place, buffer in _places(saved):
            if place < len(ids):
                entry = state.get(ids[place]) or {}
                marked.setdefault(ids[place], []).extend(
                    (name, f"param_groups[{gi}]['{KEY}']") for name in entry
                    if name in SIGNED and buffer in (None, name))
    refused = []
    for index, names in marked.items():
        entry = state.get(index) or {}
        for name, where in names:
            if torch.is_tensor(entry.get(name)) and entry[name].is_floating_point():
                refused.append((where, index, name, entry[name]))
                break
    if not refused:
        return {**state_dict,
                "state": {index: {k: v for k, v in entry.items() if k != KEY}
                          if isinstance(entry, dict) and KEY in entry else entry
                          for index, entry in state.items()},
                "param_groups": [{k: v for k, v in saved.items() if k != KEY}
                                 if isinstance(saved, dict) else saved
                                 for saved in saved_groups]}
    # Written into in place only if a refused buffer is one of the optimizer's own tensors
    # (DCP's load): a state_dict() of its own, its codes replaced by new float tensors, holds
    # the optimizer's tensors too, untouched.
    own = _held(t for entry in optimizer.state.values() if isinstance(entry, dict)
                for t in entry.values())
    in_place = any(_is_one_of(buffer, own) for _, _, _, buffer in refused)
    written_into_own = False
    for saved, group in zip(saved_groups, optimizer.param_groups if in_place else []):
        ids, params = saved.get("params", []), group["params"]
        if len(ids) != len(params):  # not this optimizer's groups (torch's load refuses)
            continue
        for index, p in zip(ids, params):
            own = _written_into(optimizer.state.get(p), state.get(index) or {})
            if own is not None:  # counted: every cache of the entry is built again
                own[REFUSED_LOAD] = ("a load refused for this optimizer had already written "
                                     "into its state (int8 codes read as floats, or a "
                                     "checkpoint's values beside them)")
                written_into_own = True
    where, index, name, buffer = refused[0]
    if where == KEY:
        where = f"state_dict['state'][{index!r}][{KEY!r}]"
    raise ValueError(
        f"state_dict['state'][{index!r}][{name!r}] is {buffer.dtype}, yet it was saved holding int8 "
        f"codes ({where}): read through the state_dict of an optimizer "
        "with another state_dtype? (torch.distributed.checkpoint loads into the keys and "
        "dtypes of the state_dict it is given"
        + ("; it wrote into this optimizer's own state, and each entry it wrote refuses to "
           "step until deleted or a state_dict (DCP's too) loads" if written_into_own else "")
        + ".) Load it into an optimizer made with state_dtype=torch.int8, then set the "
        "groups' state_dtype (converted at the next step)")


def _written_into(own, entry):
    """The optimizer's own entry where a tensor of the loaded entry is one of its tensors
    (DCP loaded into it in place), else None."""
    if not own:
        return None
    held = _held(own.values())
    return own if any(torch.is_tensor(t) and _is_one_of(t, held)
                      for t in entry.values()) else None


def _held(values) -> tuple:
    """The memory (storages) and the tensors themselves (ids) of the tensors among values."""
    shards = [local(t) for t in values if torch.is_tensor(t)]
    return {t.untyped_storage().data_ptr() for t in shards} - {0}, {id(t) for t in shards}


def _is_one_of(t: torch.Tensor, held: tuple) -> bool:
    """Whether t lies in memory _held found, or (empty, with none: a shard of no rows, whose
    rank must refuse as the others) is one of its tensors."""
    shard = local(t)
    return shard.untyped_storage().data_ptr() in held[0] or id(shard) in held[1]


__all__ = ["KEY", "BUFFERS", "hold_key", "hold_key_pre_hook", "mark",
           "refuse_codes_read_as_values"]
