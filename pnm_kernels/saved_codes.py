"""int8 codes in a state_dict (docs/design.md §8), marked so that they are never read as values.

`torch.distributed.checkpoint` loads a checkpoint into the keys and dtypes of the state_dict it
is given, the loading optimizer's: a checkpoint of int8 state read through the state_dict of
an optimizer with float state fills its float buffers with the codes cast to floats (127.0)
and drops the scales, and the next step would take them for momenta. Each saved group says
whether its int8-state parameters' entries hold codes (a group key, which DCP loads from the
checkpoint like the lr); load_state_dict refuses such a group whose entries then come as
anything else. A group switched to int8 and saved before its next step still holds float
state, so the group's state_dtype alone could not tell."""
import torch

from .quantization import SIGNED, row_length, scale_name

# The group key of state_dict(): True where the group's int8-state entries hold codes.
KEY = "saved_int8_codes"


def mark(optimizer, state_dict) -> None:
    """state_dict post-hook: each saved group's KEY."""
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        saved[KEY] = _holds_codes(optimizer.state, group)


def _holds_codes(state, group) -> bool:
    if group.get("state_dtype") is not torch.int8:
        return False
    entries = [state.get(p) for p in group["params"] if row_length(p.shape) is not None]
    entries = [entry for entry in entries if entry]
    return bool(entries) and all(_codes_with_scales(entry, name) for entry in entries
                                 for name in entry if name in SIGNED)


def _codes_with_scales(entry: dict, name: str) -> bool:
    codes = entry[name]
    return (torch.is_tensor(codes) and codes.dtype in (torch.int8, torch.uint8)
            and torch.is_tensor(entry.get(scale_name(name))))


def refuse_codes_read_as_values(state_dict: dict, param_groups) -> list:
    """Raises, naming the entry, where a group saved with codes comes with an int8-state
    entry holding floats without scales; returns the saved groups without KEY (it is
    not a hyper-parameter)."""
    state = state_dict.get("state", {})
    saved_groups = state_dict.get("param_groups", [])
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not saved.get(KEY):
            continue
        for index, p in zip(saved["params"], group["params"]):
            entry = state.get(index) or {}
            if row_length(p.shape) is None:
                continue
            for name in [name for name in entry if name in SIGNED]:
                value = entry[name]
                # (Codes without scales are the step's to refuse, as in any checkpoint.)
                if (torch.is_tensor(value) and value.is_floating_point()
                        and scale_name(name) not in entry):
                    raise ValueError(
                        f"state_dict['state'][{index!r}][{name!r}] is {value.dtype} without int8 "
                        f"codes' scales, yet param_groups[{gi}] was saved holding int8 codes "
                        "(state_dtype=torch.int8): read through the state_dict of an "
                        "optimizer with another state_dtype? (torch.distributed.checkpoint "
                        "loads into the keys and dtypes of the state_dict it is given.) Load "
                        "it into an optimizer made with state_dtype=torch.int8, then set the "
                        "groups' state_dtype (converted at the next step)")
    return [{k: v for k, v in saved.items() if k != KEY} for saved in saved_groups]


__all__ = ["KEY", "mark", "refuse_codes_read_as_values"]
