"""Hyper-parameters set between a backward pass that stepped inside itself and its step()
(docs/design.md §9): the buckets stepped with the values set when their gradients were made,
the ordinary step would use those set at step(). Noted as a step's first gradient is made,
compared at step()."""
from .hyper import signature

# What step() says of such a change: {where} was changed ({what follows from it}).
CHANGED = ("step_in_backward: {} was changed between backward and step(): inside backward "
           "each parameter steps as soon as its gradient is made, with the hyper-parameters "
           "set then ({}). Change hyper-parameters before backward: step LR schedulers after "
           "optimizer.step()")


class HypersAtBackward:
    """Each group's hyper-parameters when this step's first gradient was made."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer
        self._seen: dict | None = None  # id(group) -> (group, its signature)

    def note(self) -> None:
        """A gradient is made (or a bucket steps): the values now, if none were noted."""
        if self._seen is None:
            keys = _step_keys(self._optimizer)
            self._seen = {id(group): (group, signature(group, keys))
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
        return None


def _step_keys(optimizer) -> tuple:
    """The group keys that change what a step computes (the backend only how)."""
    return tuple(key for key in optimizer._keys if key != "backend")


__all__ = ["CHANGED", "HypersAtBackward"]
