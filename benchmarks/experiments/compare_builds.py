"""Times the optimizer step of two (or more) builds of pnm_kernels side by side: each build is
a directory holding a built package (e.g. a `git worktree` of an older commit after
`python setup.py build_ext --inplace`), imported in its own process, the builds alternating
round by round so that drift of a shared machine's speed falls on all of them alike.

    python benchmarks/experiments/compare_builds.py OLD_TREE NEW_TREE [--device cuda]
        [--sets tiny2000,tiny2000-2groups,gpt2-124m,flat64M] [--backends fused,triton]

Prints a table of median step times (ms) and each build's ratio to the first. A set named
`<set>-2groups` splits the set's tensors between two param groups: a step of several
batches, which repeats through StepLists.take_own_grads (every held list checked first)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/, for bench_common


def _child(args):
    import torch

    from bench_common import SETS
    from pnm_kernels import PNM, AdaPNM

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for set_name in args.sets.split(","):
        base = set_name.removesuffix("-2groups")
        shapes = SETS[base]()
        for opt_cls in (PNM, AdaPNM):
            for backend in args.backends.split(","):
                gen = torch.Generator().manual_seed(0)
                params = [torch.randn(s, generator=gen).to(device).requires_grad_()
                          for s in shapes]
                for p in params:
                    p.grad = torch.randn_like(p)
                if base != set_name:
                    half = len(params) // 2
                    param_groups = [dict(params=params[:half]),
                                    dict(params=params[half:], lr=5e-4)]
                else:
                    param_groups = params
                try:
                    opt = opt_cls(param_groups, lr=1e-3, backend=backend)
                    for _ in range(5):
                        opt.step()
                except (RuntimeError, ValueError) as e:
                    print(f"# {set_name} {opt_cls.__name__} {backend}: {e}", file=sys.stderr)
                    continue
                times = []
                for _ in range(args.reps):
                    sync()
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        opt.step()
                    sync()
                    times.append((time.perf_counter() - start) / args.steps * 1e3)
                out.append(dict(set=set_name, optimizer=opt_cls.__name__, backend=backend,
                                ms=statistics.median(times)))
                del opt, params, param_groups
    print(json.dumps(out))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sets", default="tiny2000,tiny2000-2groups,gpt2-124m,flat64M")
    parser.add_argument("--backends", default="fused,triton")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    results = {}  # (set, optimizer, backend, tree) -> [ms per round]
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else args.trees[::-1]
        for tree in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", args.device,
                   "--sets", args.sets, "--backends", args.backends, "--reps", str(args.reps),
                   "--steps", str(args.steps)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE)
            if done.returncode != 0:
                sys.exit(f"{tree}: {done.stderr[-2000:]}")
            sys.stderr.write(done.stderr)
            for row in json.loads(done.stdout.strip().splitlines()[-1]):
                key = (row["set"], row["optimizer"], row["backend"], tree)
                results.setdefault(key, []).append(row["ms"])
    names = [os.path.basename(os.path.normpath(t)) or t for t in args.trees]
    print(f"| set | optimizer | backend | {' | '.join(f'{n} ms' for n in names)} | "
          f"{' | '.join(f'{n} / {names[0]}' for n in names[1:])} |")
    print("|---|---|---|" + "---|" * (2 * len(names) - 1))
    for key in sorted({k[:3] for k in results}, key=lambda k: (k[0], k[1], k[2])):
        ms = [statistics.median(results.get(key + (t,), [float("nan")])) for t in args.trees]
        ratios = [m / ms[0] for m in ms[1:]]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(f'{m:.3f}' for m in ms)} | "
              f"{' | '.join(f'{x:.2f}' for x in ratios)} |")


if __name__ == "__main__":
    main()
