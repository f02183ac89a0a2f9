"""What a state_dict must be before load_state_dict replaces anything (docs/edits.md, "State
no step can use"): each check raises naming the entry, with nothing loaded. What only a step can
use or refuse (a counter that is no whole number, codes beside no scales) loads as it is and
is refused by the step, naming it (state.check_state): a load never stops half way."""
from collections.abc import Mapping

import torch

from .backends.base import ADAPNM_BUFFERS, PNM_BUFFERS
from .params import local
from .quantization import scale_name
from .state import keys_read


def refuse_malformed_entries(state_dict: dict) -> None:
    """Raises, naming it, where `state` is no mapping or an entry of it no dict of keys (a
    list, a tensor): torch's loader would fail on it past this optimizer's checks, with an
    error that names nothing."""
    state = state_dict.get("state", {})
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict['state'] is {type(state).__name__}, not a dict of "
                         "each parameter's state. Nothing was loaded")
    for index, entry in state.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"state_dict['state'][{index!r}] is {type(entry).__name__}, not "
                             "a dict of the parameter's state. Nothing was loaded")


def refuse_meta_state(state_dict: dict, param_groups) -> None:
    """Raises, naming the entry and key, where a saved tensor is on the meta device (no data:
    the state_dict of a dry run on a meta model) for a parameter with data. Torch's loader
    copies every buffer to its parameter's device (which a meta tensor cannot give), and the
    step counters are converted after it: either would stop the load half way."""
    for index, (p, entry) in _saved_entries(state_dict, param_groups).items():
        if local(p).is_meta:
            continue  # a meta model loads meta state
        for key, value in entry.items():
            if torch.is_tensor(value) and local(value).is_meta:
                raise ValueError(
                    f"state_dict['state'][{index!r}][{key!r}] is on the meta device (no data), "
                    "beside a parameter with data: the state_dict of a dry run? Nothing was "
                    "loaded")


def _saved_entries(state_dict: dict, param_groups) -> dict:
    """{saved index: (parameter, entry)} by torch's mapping of saved ids to parameters (their
    order in param_groups); groups torch would refuse to map give what they can."""
    ids = [i for group in state_dict.get("param_groups", []) if isinstance(group, Mapping)
           for i in group.get("params", [])]
    params = [p for group in param_groups for p in group["params"]]
    state = state_dict.get("state", {})
    return {i: (p, state[i]) for i, p in zip(ids, params) if i in state}


# Every key a step of PNM's or AdaPNM's reads: an entry holding one is optimizer state.
_ANY_BUFFER_KEY = frozenset(keys_read(PNM_BUFFERS + ADAPNM_BUFFERS))


def refuse_foreign_state(state_dict: dict, names: tuple, group_keys: tuple,
                          optimizer: str, converted: bool = False) -> None:
    """Raises, naming the entry, where a saved entry holds none of this optimizer's buffers
    but keys it never holds: another optimizer's state (SGD's momentum_buffer, RMSprop's
    square_avg), whose step counter would carry over onto fresh buffers. Keys of a user's own
    beside this optimizer's buffers stay, as torch's optimizers keep them, and so does an
    entry of a user's keys alone (a parameter not stepped yet) where the groups were saved
    by PNM or AdaPNM (they hold this optimizer's hyper-parameter keys: `backend`...). And a
    group without betas (SGD's), or with an eps that PNM has not (AdamW's: one never stepped
    has no entry to tell), unless `converted` (a pre-hook of the user's ran: its converter
    may leave keys to the defaults)."""
    own = set(keys_read(names))
    ours = all(set(group_keys) <= group.keys() for group in state_dict.get("param_groups", []))
    for index, entry in state_dict.get("state", {}).items():
        foreign = sorted(str(key) for key in entry if key not in own)
        if ours and not any(key in _ANY_BUFFER_KEY for key in entry):
            continue  # a user's own keys on a parameter with no state of ours
        if foreign and not any(name in entry for name in names):
            raise ValueError(
                f"state_dict['state'][{index!r}] holds {', '.join(map(repr, foreign))} and none "
                f"of {optimizer}'s buffers ({', '.join(names)}): the state_dict of another "
                "optimizer? Load the model's weights alone, and let this optimizer's state "
                "start afresh")
    for gi, group in enumerate(state_dict.get("param_groups", []) if not (
            converted or ours) else []):
        # Every version of the authors' optimizers saves betas, and their PNM no eps (ours
        # hold this optimizer's keys: an eps there is a user's own).
        odd = None if not isinstance(group, dict) else "has no 'betas'" if (
            "betas" not in group) else "has an 'eps'" if (
            "eps" in group and "eps" not in group_keys) else None
        if odd:
            raise ValueError(
                f"state_dict['param_groups'][{gi}] {odd}, unlike {optimizer}'s groups: the "
                "state_dict of another optimizer (its hyper-parameters would be read as this "
                "one's: AdamW's beta2 as beta0)? Convert it in a load_state_dict pre-hook, or "
                "let this optimizer start afresh")


def refuse_negative_scales(state_dict: dict, names: tuple) -> None:
    """Raises, naming the entry and key, where saved int8 block scales hold a negative value,
    which no quantisation makes (a block's scale is its largest magnitude): a corrupted or
    hand-made checkpoint, whose decoded momenta would change sign and second moments have
    no root. Read here, once (a step does not read scales back; a NaN scale, of state that
    diverged, loads as saved)."""
    for index, entry in state_dict.get("state", {}).items():
        for key in map(scale_name, names):
            scales = entry.get(key) if isinstance(entry, dict) else None
            if not (torch.is_tensor(scales) and scales.is_floating_point()):
                continue  # not scales: the step names what is wrong with it
            scales = local(scales)
            if not scales.is_meta and bool((scales < 0).any()):
                raise ValueError(
                    f"state_dict['state'][{index!r}][{key!r}] holds a negative block scale "
                    f"({float(scales.min())}), which no int8 state has: a corrupted "
                    "checkpoint? Nothing was loaded")


def saved_tensors(state_dict: dict, param_groups) -> dict:
    """{parameter: {key: tensor}} of a state_dict's state, by torch's mapping of saved ids
    to parameters (their order in param_groups)."""
    return {p: {k: v for k, v in entry.items() if torch.is_tensor(v)}
            for p, entry in _saved_entries(state_dict, param_groups).values()}
