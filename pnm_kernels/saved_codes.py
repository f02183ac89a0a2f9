"""int8 codes in a state_dict (docs/design.md §8), marked so that they are never read as values.

`torch.distributed.checkpoint` loads a checkpoint into the keys and dtypes of the state_dict it
is given, the loading optimizer's: a checkpoint of int8 state read through the state_dict of
an optimizer with float state fills its float buffers with the codes cast to floats (127.0),
and the next step would take them for momenta. Each saved group lists the places (in its
params) of the entries that hold codes (a group key, which DCP loads from the checkpoint like
the lr); load_state_dict refuses such an entry that then comes as floats. Per entry: a group
switched to int8 converts a parameter's state at its next step, so one group may hold codes
and float state side by side.

How torch's state_dict utilities carry the key decides its form:
- Every live group holds KEY too (None; only saved groups list places): with
  flatten_optimizer_state_dict=True they rebuild the loaded groups from the loading
  optimizer's own group keys, and would drop a key only saved groups held.
- The places are one string ("0,2"): they flatten a list into a key per element, and with
  full_state_dict take only the keys the loading optimizer's own state_dict has, so a list of
  another length would be cut short, or (broadcast_from_rank0) reach rank 0 alone.
- The refusal does not ask whether scales came too: with broadcast_from_rank0, rank 0's
  entries get the checkpoint's keys the loading optimizer lacks (its scales), the other
  ranks' do not, and every rank must refuse alike.

DCP writes into the tensors of the state_dict it is given, which are the loading optimizer's
own state (`dcp.load(get_optimizer_state_dict(...))`): by the time load_state_dict refuses,
those buffers hold the codes as values. Such an entry is marked (REFUSED_LOAD), and a step
refuses it, naming it, until it is deleted or a state_dict loads."""
import torch

from .quantization import SIGNED, scale_name
from .state import CODE_DTYPES, REFUSED_LOAD, is_dtensor

# The group key of state_dict(): the places of the group's entries that hold int8 codes.
KEY = "saved_int8_codes"


def hold_key(groups) -> None:
    """Gives each live group KEY (None) where it has none: a group added by hand too."""
    for group in groups:
        group.setdefault(KEY, None)


def hold_key_pre_hook(optimizer) -> None:
    """state_dict pre-hook: DCP's flattened load reads the loading optimizer's group keys."""
    hold_key(optimizer.param_groups)


def mark(optimizer, state_dict) -> None:
    """state_dict post-hook: each saved group's KEY."""
    state = optimizer.state
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        saved[KEY] = ",".join(str(i) for i, p in enumerate(group["params"])
                              if _holds_codes(state.get(p)))


def _holds_codes(entry) -> bool:
    return bool(entry) and any(_is_codes(entry[name]) and torch.is_tensor(entry.get(scale_name(name)))
                               for name in entry if name in SIGNED)


def _is_codes(value) -> bool:
    return torch.is_tensor(value) and value.dtype in CODE_DTYPES


def _places(saved) -> list:
    """A saved group's KEY as places: "0,2" (or the list an earlier version saved)."""
    value = saved.get(KEY)
    items = value.split(",") if isinstance(value, str) else value or []
    return [int(item) for item in items if str(item).strip().isdigit()]


def refuse_codes_read_as_values(optimizer, state_dict: dict) -> list:
    """Raises, naming the first, where entries saved holding codes come holding floats
    (marking each of the optimizer's own entries the floats were written into); returns the
    saved groups without KEY (it is not a hyper-parameter)."""
    state = state_dict.get("state", {})
    saved_groups = state_dict.get("param_groups", [])
    groups = optimizer.param_groups
    refused, written_into_own = [], False
    for gi, saved in enumerate(saved_groups):
        ids = saved.get("params", [])
        # The loading optimizer's parameters in those places (where the groups match, as
        # torch's load requires).
        params = groups[gi]["params"] if gi < len(groups) else []
        for place in _places(saved):
            index = ids[place] if place < len(ids) else None
            entry = state.get(index) or {}
            read = [name for name in entry if name in SIGNED
                    and torch.is_tensor(entry[name]) and entry[name].is_floating_point()]
            if not read:
                continue
            refused.append((gi, index, read[0], entry[read[0]].dtype))
            written = _written_into(optimizer.state.get(params[place])
                                    if len(params) == len(ids) else None, entry)
            if written is not None:  # counted: every cache of the entry is built again
                written[REFUSED_LOAD] = ("a load refused for it had already written int8 codes "
                                         "into its state as floats")
                written_into_own = True
    if refused:
        gi, index, name, dtype = refused[0]
        raise ValueError(
            f"state_dict['state'][{index!r}][{name!r}] is {dtype}, yet it was saved holding "
            f"int8 codes (param_groups[{gi}]['{KEY}']): read through the state_dict of an "
            "optimizer with another state_dtype? (torch.distributed.checkpoint loads into the "
            "keys and dtypes of the state_dict it is given"
            + ("; it wrote into this optimizer's own state, whose entries it wrote refuse to "
               "step until deleted or a state_dict loads" if written_into_own else "")
            + ".) Load it into an optimizer made with state_dtype=torch.int8, then set the "
            "groups' state_dtype (converted at the next step)")
    return [{k: v for k, v in saved.items() if k != KEY} for saved in saved_groups]


def _written_into(own, entry):
    """The optimizer's own entry where a tensor of the loaded entry is one of its tensors
    (DCP loaded into it in place), else None."""
    if not own:
        return None
    held = {_storage(t) for t in own.values() if torch.is_tensor(t)} - {0}
    return own if any(torch.is_tensor(t) and _storage(t) in held for t in entry.values()) else None


def _storage(t: torch.Tensor) -> int:
    """Where t's memory lies (0: none, an empty tensor's)."""
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return local.untyped_storage().data_ptr()


__all__ = ["KEY", "hold_key", "hold_key_pre_hook", "mark", "refuse_codes_read_as_values"]
