"""Host time of the check that no gradient lies in memory a step writes (docs/edits.md,
csrc/written_memory.h): a repeated step (float32 state: its gradients looked up in C++) and a
planned one (bfloat16 state: every cached batch's gradients, read in C++), with the check
and without it (an empty WrittenMemory under the repeated step's lists; the planned step's
lookup skipped), alternating round by round in one process. AdaPNM-AMSGrad, fused, many
small tensors: host work, not memory traffic.

    python benchmarks/experiments/written_memory.py [--tensors 2000] [--numel 1] [--rounds 15]
"""
import argparse
import statistics
import time

import torch

from pnm_kernels import AdaPNM
from pnm_kernels.batching import BatchCache

_LOOKUP = BatchCache.grad_in_written


def _check(opt, on: bool) -> None:
    BatchCache.grad_in_written = _LOOKUP if on else (lambda *args: False)  # type: ignore
    remembered = opt._repeat._last
    if remembered is not None:
        written = torch.classes.pnm_kernels.WrittenMemory()
        for _, batch in remembered[2]:
            written.add_lists(batch.held.step_lists)
        for _, batch in remembered[2]:
            batch.held.step_lists.watch_written(
                written if on else torch.classes.pnm_kernels.WrittenMemory())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for label, state_dtype in (("repeated, float32 state", None),
                               ("planned, bfloat16 state", torch.bfloat16)):
        params = [torch.randn(args.numel, requires_grad=True) for _ in range(args.tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = AdaPNM(params, lr=1e-3, backend="fused", state_dtype=state_dtype)
        for _ in range(5):
            opt.step()
        times: dict = {True: [], False: []}
        for r in range(2 * args.rounds):
            on = r % 2 == 0
            _check(opt, on)
            start = time.perf_counter()
            for _ in range(20):
                opt.step()
            times[on].append((time.perf_counter() - start) / 20 * 1e3)
        _check(opt, True)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"{label}: {args.tensors} x {args.numel}: {on:.3f} ms a step checked, "
              f"{off:.3f} unchecked (median of {args.rounds} rounds of 20), "
              f"{(on - off) / args.tensors * 1e6:+.0f} ns a gradient")


if __name__ == "__main__":
    main()
