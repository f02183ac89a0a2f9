"""backend="reference": pnm_kernels.reference's per-parameter steps, the ground truth."""
from typing import Any, Optional

import torch

from .. import reference
from ..hyper import Hyper
from ..quantization import scale_name
from .base import ADAPNM_BUFFERS, PNM_BUFFERS, Batch, HeldLists, Launch, Scaling


def skip_step(found_inf: Optional[torch.Tensor]) -> bool:
    # Host read: the reference and foreach backends are not capturable anyway.
    return found_inf is not None and bool(found_inf.item())


# Under torch.compile the reference runs eagerly (a graph break, as its host reads make one
# anyway): traced, the step count it reads became a symbol, and inductor compiled the random
# bits' integer hash as float ops and failed midway through a step. torch's lazy form of
# torch._dynamo.disable: importing dynamo would make `import pnm_kernels` slow.
@torch._disable_dynamo
def _untraced_step(backend: "ReferenceBackend", batch: Batch, hyper: Hyper,
                   scaling: Scaling) -> None:
    backend._step(batch, hyper, scaling)


class ReferenceBackend:
    name = "reference"
    flat = False
    holds_lists = False
    reads_host = True

    def step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        if torch.compiler.is_compiling():
            _untraced_step(self, batch, hyper, scaling)
        else:
            self._step(batch, hyper, scaling)

    def _step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        if skip_step(scaling.found_inf):
            return
        if batch.params[0].device.type == "meta":  # no values to compute, as foreach's
            torch._foreach_add_(batch.steps, 1.0)  # only the counters advance
            return
        names = ADAPNM_BUFFERS if hyper.adaptive else PNM_BUFFERS
        common: dict[str, Any] = dict(
            lr=float(hyper.lr), beta1=hyper.beta1, beta0=hyper.beta0,
            weight_decay=hyper.weight_decay, decoupled=hyper.decoupled, maximize=hyper.maximize,
            grad_scale=scaling.grad_scale, state_dtype=hyper.state_dtype,
            bf16_stochastic_round=hyper.bf16_stochastic_round)
        for i, (param, grad) in enumerate(zip(batch.params, batch.grads)):
            state = {name: buffers[i] for name, buffers in zip(names, batch.buffers)}
            state["step"] = batch.steps[i]
            for name, scales in zip(names, batch.scales):  # int8 state
                if scales[i] is not None:
                    state[scale_name(name)] = scales[i]
            if batch.seeds:  # stochastic rounding: its random bits' seed and index offset
                state["seed"] = batch.seeds[i]
                common["offset"] = batch.offsets[i]
            if hyper.adaptive:
                reference.adapnm_step(param, grad, state, beta2=hyper.beta2, eps=hyper.eps,
                                      amsgrad=hyper.amsgrad, **common)
            else:
                reference.pnm_step(param, grad, state, **common)

    def prepare_repeat(self, held: HeldLists, device: torch.device, dtype: torch.dtype,
                       hyper: Hyper, use_taken: bool) -> Optional[Launch]:
        return None  # holds no lists
