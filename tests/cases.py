"""The table of cases the tests iterate: optimizer x backend path x dtype x state mode, in
the spirit of torch's OptimizerInfo (torch/testing/_internal/common_optimizers.py).

One row per backend path in PATHS, one per optimizer in OPTIMIZERS: a new backend path is one
row, and every test that iterates the paths it belongs to (FAST_PATHS, KERNEL_PATHS, ...)
runs on it. The state modes (state in a dtype of its own, bf16 parameters rounded
stochastically) are STATE_MODES, each with the parameter dtypes it applies to, kept by the
paths in STATE_DTYPE_PATHS: a new mode is one entry there, and test_state_dtype.py's
comparison with the reference (every path, optimizer, parameter dtype and variant) and its
check of the CUDA kernels' bits run on it. int8 state (INT8_PATHS) has tests of its own,
test_int8_state.py, as its codes and scales are compared otherwise. A test asks for its cases
with `parametrize(paths, ...)`, which gives the pytest parametrisation, the backend path
going through conftest's `path` fixture (which skips what this machine cannot run and sets
PNM_KERNELS_EMULATE_CUDA for "emulated").

conftest imports this module; it reads conftest's HAS_TRITON only when a test is
parametrised with plain backend names.
"""
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from pnm_kernels import PNM, AdaPNM

HAS_CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Path:
    """A way of running the step, as the tests name it."""

    name: str
    fast: bool  # a fast path: checked against the reference
    kernel: bool  # compiled kernels (fused, emulated, Triton), whose steps repeat on held lists
    float64: bool  # takes float64 parameters
    with_a_gpu: bool = True  # among the fast paths on a machine with a GPU too
    needs: Optional[str] = None  # "extension" (pnm_kernels._C) or "triton"


# "emulated" is backend="fused" on CPU tensors with PNM_KERNELS_EMULATE_CUDA=1: the CUDA
# kernels' own code, walked block by block and thread by thread on the host.
PATHS = (
    Path("foreach", fast=True, kernel=False, float64=True),
    Path("fused", fast=True, kernel=True, float64=True, needs="extension"),
    Path("emulated", fast=True, kernel=True, float64=True, with_a_gpu=False, needs="extension"),
    Path("triton", fast=True, kernel=True, float64=False, needs="triton"),
    Path("reference", fast=False, kernel=False, float64=True),
)
PATH = {p.name: p for p in PATHS}

OPTIMIZERS = {"PNM": PNM, "AdaPNM": AdaPNM}

# state_dtype modes (docs/design.md §7): the state in a dtype of its own, and the paths that
# keep it. A path that learns to keep such state is one entry here.
# Each mode's optimizer arguments and the parameter dtypes it is a mode of (where it changes
# nothing, float32 state of float32 parameters say, it is no case).
STATE_MODES = {
    "bf16-state": (dict(state_dtype=torch.bfloat16),
                   (torch.float32, torch.bfloat16, torch.float16)),
    "fp32-state": (dict(state_dtype=torch.float32), (torch.bfloat16, torch.float16)),
    "bf16-sr": (dict(bf16_stochastic_round=True), (torch.bfloat16,)),
    "bf16-state-sr": (dict(state_dtype=torch.bfloat16, bf16_stochastic_round=True),
                      (torch.bfloat16,)),
}
STATE_DTYPE_PATHS = ("foreach", "fused", "emulated", "triton")
# state_dtype=torch.int8 (pnm_kernels/quantization.py): the paths that keep it.
INT8_PATHS = ("foreach", "fused", "emulated", "triton")

# Every fast path this machine runs, in the suite's order.
FAST_PATHS = [p.name for p in PATHS if p.fast and (p.with_a_gpu or not HAS_CUDA)]
# The paths whose steps repeat on held lists (the CUDA emulation included on every machine).
KERNEL_PATHS = [p.name for p in PATHS if p.kernel]
# The paths of the fused kernels: compiled for the device, or the CUDA ones emulated.
FUSED_PATHS = [p.name for p in PATHS if p.needs == "extension"]
# The fast paths this machine runs that take float64 parameters.
FLOAT64_FAST_PATHS = [name for name in FAST_PATHS if PATH[name].float64]


@dataclass(frozen=True)
class Case:
    """One case: an optimizer on one backend path, with one parameter dtype (None: the
    test's own dtypes) and one state mode (None: the default)."""

    optimizer: type
    path: str
    dtype: Optional[torch.dtype] = None
    mode: Optional[str] = None

    @property
    def name(self):
        return self.optimizer.__name__

    @property
    def id(self):
        parts = [self.name, self.path]
        if self.dtype is not None:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.mode is not None:
            parts.append(self.mode)
        return "-".join(parts)


def cases(paths, optimizers=tuple(OPTIMIZERS), dtypes=(None,), modes=(None,)):
    """The cases over `paths` (names in PATH), `optimizers` (names in OPTIMIZERS), `dtypes`
    and `modes`, path by path."""
    unknown = [p for p in paths if p not in PATH]
    assert not unknown, f"no such path: {unknown}"
    return [Case(OPTIMIZERS[name], path, dtype, mode)
            for path in paths for name in optimizers for dtype in dtypes for mode in modes]


def _value(case, arg):
    return {"name": case.name, "path": case.path, "backend": case.path, "dtype": case.dtype,
            "mode": case.mode, "optimizer": case.optimizer, "case": case}[arg]


def _availability_marks(path):
    """Skips for a path given as a plain backend name (the `path` fixture skips by itself)."""
    from conftest import HAS_TRITON
    from pnm_kernels._ops import extension_error

    needs = PATH[path].needs
    if needs == "triton":
        return [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")]
    if needs == "extension":
        return [pytest.mark.skipif(extension_error() is not None,
                                   reason="pnm_kernels._C is not built")]
    return []


def parametrize(paths, optimizers=tuple(OPTIMIZERS), dtypes=(None,), modes=(None,),
                args=("name", "path")):
    """The pytest parametrisation over cases(paths, optimizers, dtypes, modes), giving the
    test the arguments `args` of each case: "name" (the optimizer's name, a key of
    OPTIMIZERS), "path" (through conftest's `path` fixture, which returns the backend to
    pass), "backend" (the path's name as the backend to pass, skipped where unavailable;
    not for "emulated", which needs the fixture), "dtype", "mode", "optimizer" (the class)
    or "case" (the Case)."""
    selected = cases(paths, optimizers, dtypes, modes)
    if "backend" in args:
        assert "emulated" not in paths, "'emulated' needs the path fixture"
    params = [pytest.param(*[_value(case, arg) for arg in args], id=case.id,
                           marks=_availability_marks(case.path) if "backend" in args else ())
              for case in selected]
    return pytest.mark.parametrize(",".join(args), params,
                                   indirect=["path"] if "path" in args else False)


# Tests without a backend of their own: each optimizer on its default backend.
OVER_OPTIMIZERS = pytest.mark.parametrize("name", list(OPTIMIZERS))
