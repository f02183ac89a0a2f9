"""Hyper-parameters, and the groups' parameters, set between a backward pass that stepped
inside itself and its step() (docs/design.md §9): the buckets stepped with the values and
groups set when their gradients were made, the ordinary step would use those set at step()
(a parameter taken out of the optimizer, or moved into another group, between them). Noted
as a step's first gradient is made, compared at step()."""
from .hyper import signature

# What step() says of such a change: {where} was changed ({what follows from it}).
CHANGED = ("step_in_backward: {} was changed between backward and step(): inside backward "
           "each parameter steps as soon as its gradient is made, with the hyper-parameters "
           "and groups set then ({}). Change hyper-parameters and groups before backward: "
           "step LR schedulers after optimizer.step()")


class HypersAtBackward:
    """Each group's hyper-parameters and parameters when this step's first gradient was
    made."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer
        # id(group) -> (group, its signature, its parameters' ids)
        self._seen: dict | None = None

    def note(self) -> None:
        """A gradient is made (or a bucket steps): the values now, if none were noted."""
        if self._seen is None:
            keys = _step_keys(self._optimizer)
            self._seen = {id(group): (group, signature(group, keys),
                                      tuple(map(id, group["params"])))
                          for group in self._optimizer.param_groups}

    def forget(self) -> None:
        self._seen = None

    def changed(self) -> str | None:
        """Where a hyper-parameter was changed since they were noted
        (`param_groups[i]['key']`), or None; forgets them."""
        seen, self._seen = self._seen, None
        if seen is None:
            return None
        keys = _step_keys(self._optimizer)
        for gi, group in enumerate(self._optimizer.param_groups):
            before = seen.get(id(group))
            if before is None or before[0] is not group:
                continue  # a group added since: it had nothing stepped
            for key, old, new in zip(keys, before[1], signature(group, keys)):
                if old != new:
                    return f"param_groups[{gi}][{key!r}]"
            now = tuple(map(id, group["params"]))
            if now != before[2] and not set(before[2]) <= set(now):  # added to: no matter
                return (f"param_groups[{gi}]['params'] (a parameter taken out of it, or "
                        "moved into another group)")
        return None


def _step_keys(optimizer) -> tuple:
    """The group keys that change what a step computes (the backend only how)."""
    return tuple(key for key in optimizer._keys if key != "backend")


__all__ = ["CHANGED", "HypersAtBackward"]
