"""int8 codes in a state_dict (docs/design.md §8), marked so that they are never read as values.

`torch.distributed.checkpoint` loads a checkpoint into the keys and dtypes of the state_dict it
is given, the loading optimizer's: a checkpoint of int8 state read through the state_dict of
an optimizer with float state fills its float buffers with the codes cast to floats (127.0)
and drops the scales, and the next step would take them for momenta. Each saved group lists
the places (in its params) of the entries that hold codes (a group key, which DCP loads from
the checkpoint like the lr); load_state_dict refuses such an entry that then comes as floats
without scales. Per entry: a group switched to int8 converts a parameter's state at its next
step, so one group may hold codes and float state side by side.

Every live group holds KEY too (None; only saved groups list places): torch's
get_optimizer_state_dict / set_optimizer_state_dict with flatten_optimizer_state_dict=True
rebuild the groups they load from the loading optimizer's own group keys, and a key only
saved groups held would be dropped there, the codes then loading as values unseen."""
import torch

from .quantization import SIGNED, scale_name
from .state import CODE_DTYPES

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
        saved[KEY] = [i for i, p in enumerate(group["params"]) if _holds_codes(state.get(p))]


def _holds_codes(entry) -> bool:
    return bool(entry) and any(_is_codes(entry[name]) and torch.is_tensor(entry.get(scale_name(name)))
                               for name in entry if name in SIGNED)


def _is_codes(value) -> bool:
    return torch.is_tensor(value) and value.dtype in CODE_DTYPES


def refuse_codes_read_as_values(state_dict: dict) -> list:
    """Raises, naming the entry, where an entry saved holding codes comes holding floats
    without scales; returns the saved groups without KEY (it is not a hyper-parameter)."""
    state = state_dict.get("state", {})
    saved_groups = state_dict.get("param_groups", [])
    for gi, saved in enumerate(saved_groups):
        ids = saved.get("params", [])
        for place in saved.get(KEY) or []:
            index = ids[place] if isinstance(place, int) and 0 <= place < len(ids) else None
            entry = state.get(index) or {}
            for name in [name for name in entry if name in SIGNED]:
                value = entry[name]
                # (Codes without scales are the step's to refuse, as in any checkpoint.)
                if (torch.is_tensor(value) and value.is_floating_point()
                        and scale_name(name) not in entry):
                    raise ValueError(
                        f"state_dict['state'][{index!r}][{name!r}] is {value.dtype} without int8 "
                        f"codes' scales, yet it was saved holding int8 codes (param_groups[{gi}]"
                        f"['{KEY}']): read through the state_dict of an optimizer with another "
                        "state_dtype? (torch.distributed.checkpoint loads into the keys and "
                        "dtypes of the state_dict it is given.) Load it into an optimizer made "
                        "with state_dtype=torch.int8, then set the groups' state_dtype "
                        "(converted at the next step)")
    return [{k: v for k, v in saved.items() if k != KEY} for saved in saved_groups]


__all__ = ["KEY", "hold_key", "hold_key_pre_hook", "mark", "refuse_codes_read_as_values"]
