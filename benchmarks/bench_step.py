"""Optimizer step throughput: PNM/AdaPNM on every available backend against torch.optim.

    python benchmarks/bench_step.py [--device cpu|cuda] [--quick] [--compiled]
                                    [--dtype float32|bfloat16|float16|float64]
                                    [--sets transformer,small2000,...] [--out DIR]

Every contender runs in this one process, interleaved round by round, warm-up excluded; the
figure kept is the median over rounds. Throughput is "effective GB/s": the minimum bytes the
algorithm must move (docs/design.md §2) times the parameter count, divided by the step time, also
shown as a fraction of this device's copy bandwidth, a large copy timed in every round beside
the contenders (median per set). Ratios to torch's fused optimizers are medians of per-round
paired ratios, so slow drift in a shared machine's speed cancels. The torch.compile'd
contenders are opt-in (--compiled: compiling them takes minutes on a CPU). Writes a Markdown
table (also printed), a JSON with every figure and the machine, and a PNG figure (each step's
time over torch's fused step, per set) to benchmarks/out/, which git ignores; the tables kept
in the tree are in benchmarks/results/ (--out benchmarks/results to replace them).
"""
import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pnm_kernels import PNM, AdaPNM, available_backends, quantization  # noqa: E402
from pnm_kernels._ops import cuda_chunk_size  # noqa: E402
from pnm_kernels.backends import TRITON_DTYPES  # noqa: E402
from bench_common import (BYTES_PER_ELEMENT, SETS, STATE_COPIES, CopyProbe,  # noqa: E402
                          load_triton_configs, machine_info, synchronize, timed_steps)
from compiled_peer import CompiledPNM, CompiledAdaPNM  # noqa: E402
from bench_report import (BNB_ADAM8BIT, BNB_SGD8BIT, PEERS, TORCHAO_ADAMW8BIT,  # noqa: E402
                          copy_summary, plot, write_table)

# The CPU benchmark (benchmarks/run.sh) must end within 5 minutes on a fresh machine, install and build included
# (it took 301 s with tiny2000, 387 s with flat64M too): flat16M already sits on the memory
# floor, and small2000 shows what tiny2000 does, a step of 2,000 tensors bound by host time.
# Both run with --sets.
DEFAULT_SETS = {"cpu": ["small2000", "resnet50", "transformer", "flat1M", "flat16M"],
                "cuda": ["tiny2000", "small2000", "resnet50", "transformer", "gpt2-124m", "llama-1b",
                         "flat1M", "flat4M", "flat16M", "flat64M", "flat256M", "flat1024M"]}
QUICK_SETS = {"cpu": ["small2000", "transformer"], "cuda": ["small2000", "transformer", "flat64M"]}
# Rounds per set: the default CPU run ends in about 1.5 minutes on an idle 2-core CPU, so
# that the benchmark on a fresh machine, install and build included, ends within 5.
DEFAULT_ROUNDS = {"cpu": 7, "cuda": 15}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
STATE_NAMES = {"bfloat16": "bf16 state", "float32": "fp32 state", "int8": "int8 state"}
EIGHT_BIT_MOMENTS = {TORCHAO_ADAMW8BIT: 2, BNB_ADAM8BIT: 2, BNB_SGD8BIT: 1}


def state_label(state_dtype):
    """The label suffix of our contenders with state in a dtype of its own."""
    return f",{STATE_NAMES[str(state_dtype).replace('torch.', '')]}" if state_dtype else ""


def bytes_per_element(label, family, dtype):
    """The bytes a step moves per parameter element: parameter (read, written), gradient
    (read) and the state buffers' reads and writes (PNM: this step's buffer read and
    written, the other read; AdaPNM-AMSGrad: that and both second moments read and written),
    in the parameter's dtype or, for our contenders with their own state dtype, in that (an
    int8 code with its share of its block's float32 scale)."""
    size = torch.tensor([], dtype=dtype).element_size()
    if label in EIGHT_BIT_MOMENTS:  # each moment read and written, a float32 scale per 256
        return 3 * size + 2 * EIGHT_BIT_MOMENTS[label] * (1 + 4 / 256)
    for state_dtype, name in STATE_NAMES.items():
        if name in label:
            state_accesses = {"PNM": 3, "AdaPNM": 7}[family]
            state_size = getattr(torch, state_dtype).itemsize
            if state_dtype == "int8":
                state_size += 4 / quantization.BLOCK
            return 3 * size + state_accesses * state_size
    return BYTES_PER_ELEMENT[family] * size / 4


def contenders(device, dtype=torch.float32, state_dtype=None):
    """(label, family, factory(params)) for every optimizer compared; with state_dtype, our
    steps keeping their state in it too (those of our backends that can)."""
    out = []
    if state_dtype is not None:
        # Triton on a GPU only: on the CPU its interpreter is a correctness tool.
        ours = ("fused", "triton", "foreach") if device == "cuda" else ("fused", "foreach")
        for backend in [b for b in ours if b in available_backends(device)]:
            suffix = state_label(state_dtype)
            out.append((f"PNM[{backend}{suffix}]", "PNM", lambda ps, b=backend: PNM(
                ps, lr=1e-3, betas=(0.9, 1.0), backend=b, state_dtype=state_dtype)))
            out.append((f"AdaPNM[{backend}{suffix}]", "AdaPNM", lambda ps, b=backend: AdaPNM(
                ps, lr=1e-3, amsgrad=True, backend=b, state_dtype=state_dtype)))
    for backend in available_backends(device):
        if backend == "triton" and device == "cpu":
            continue  # the Triton interpreter is a correctness tool, not a contender
        if backend == "triton" and dtype not in TRITON_DTYPES:
            continue
        out.append((f"PNM[{backend}]", "PNM",
                    lambda ps, b=backend: PNM(ps, lr=1e-3, betas=(0.9, 1.0), backend=b)))
        out.append((f"AdaPNM[{backend}]", "AdaPNM",
                    lambda ps, b=backend: AdaPNM(ps, lr=1e-3, amsgrad=True, backend=b)))
    # What a user might try instead of a fused kernel: the per-parameter reference with its
    # step wrapped in torch.compile, and the maths written in foreach ops for torch.compile.
    out.append(("PNM[reference+torch.compile]", "PNM", lambda ps: _compiled(
        PNM(ps, lr=1e-3, betas=(0.9, 1.0), backend="reference"))))
    out.append(("AdaPNM[reference+torch.compile]", "AdaPNM", lambda ps: _compiled(
        AdaPNM(ps, lr=1e-3, amsgrad=True, backend="reference"))))
    out.append(("PNM[user foreach+torch.compile]", "PNM", lambda ps: CompiledPNM(ps, lr=1e-3)))
    out.append(("AdaPNM[user foreach+torch.compile]", "AdaPNM",
                lambda ps: CompiledAdaPNM(ps, lr=1e-3)))
    if state_dtype == torch.int8:
        try:  # the low-bit peer, where it installs (never a dependency)
            from torchao.optim import AdamW8bit
            out.append((TORCHAO_ADAMW8BIT, "AdaPNM", lambda ps: AdamW8bit(ps, lr=1e-3)))
        except ImportError:
            pass
        try:
            import bitsandbytes
            out.append((BNB_ADAM8BIT, "AdaPNM",
                        lambda ps: bitsandbytes.optim.Adam8bit(ps, lr=1e-3)))
            out.append((BNB_SGD8BIT, "PNM",
                        lambda ps: bitsandbytes.optim.SGD8bit(ps, lr=1e-3, momentum=0.9)))
        except ImportError:
            pass
    try:  # an optional peer, never a dependency
        import pytorch_optimizer
        out.append(("pytorch_optimizer.PNM", "PNM",
                    lambda ps: pytorch_optimizer.PNM(ps, lr=1e-3, betas=(0.9, 1.0))))
        out.append(("pytorch_optimizer.AdaPNM", "AdaPNM",
                    lambda ps: pytorch_optimizer.AdaPNM(ps, lr=1e-3, amsgrad=True)))
    except ImportError:
        pass
    for impl in ("foreach", "fused", "foreach+torch.compile"):
        flag = {impl.split("+")[0]: True}
        wrap = _compiled if impl.endswith("torch.compile") else (lambda opt: opt)
        out.append((f"torch.SGD-momentum[{impl}]", "SGD-momentum", lambda ps, f=flag, w=wrap:
                    w(torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **f))))
        out.append((f"torch.Adam-amsgrad[{impl}]", "Adam-amsgrad", lambda ps, f=flag, w=wrap:
                    w(torch.optim.Adam(ps, lr=1e-3, amsgrad=True, **f))))
        if device == "cuda" and not impl.endswith("torch.compile"):
            out.append((f"torch.AdamW-amsgrad[{impl}]", "Adam-amsgrad",
                        lambda ps, f=flag: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True, **f)))
    return out


def _compiled(opt):
    """The optimizer with its step wrapped in torch.compile, as torch's tutorial on compiling
    the optimizer does (compiled during warm-up)."""
    opt.step = torch.compile(opt.step)
    return opt


class Progress:
    """A one-line progress bar on stderr that names what runs now: a round of a set, or a
    contender's warm-up (a compile, which takes long, included)."""

    WIDTH = 60  # characters of the label: bar and label fit in 100 columns

    def __init__(self, total):
        self.total, self.done, self.start = total, 0, time.time()

    def show(self, label):
        """Names what runs next, without counting a round done."""
        filled = int(12 * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (12 - filled)}] {self.done}/{self.total} "
                         f"{time.time() - self.start:4.0f}s {label[:self.WIDTH]:<{self.WIDTH}}")
        sys.stderr.flush()

    def advance(self, label, count=1):
        self.done += count
        self.show(label)
        if self.done == self.total:
            sys.stderr.write("\n")


def fits_in_memory(family_bytes, numel, dtype, device):
    """Parameters, gradients and the largest optimizer state, with room to spare."""
    need = numel * torch.tensor([], dtype=dtype).element_size() * family_bytes / 4 * 1.5
    if device == "cuda":
        return need < torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return True
    return need < avail


def bench_set(name, shapes, device, dtype, rounds, steps_per_round, progress,
              skip_compiled=True, copy_probe=None, state_dtype=None):
    """Every contender on one parameter set. All contenders share the parameters and
    gradients (their values do not change the work) and run interleaved, round by round,
    when all their states fit in memory together; otherwise one after the other. With a
    copy_probe, a copy is timed in every round too (in the rotation, or after each contender's
    round), and each row carries the set's median copy bandwidth."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    if not fits_in_memory(12, numel, dtype, device):  # p, g, m, m_other, v, v_max (+ copies)
        progress.advance(f"{name}: skipped (memory)", rounds)
        return [dict(set=name, label="(all)", family="-", numel=numel, tensors=len(shapes),
                     error="skipped: does not fit in this device's memory")]
    entries = []
    for label, family, factory in contenders(device, dtype, state_dtype):
        if label.endswith("[reference]") and (numel > ((64 if device == "cuda" else 16) << 20) or
                                              (device == "cuda" and len(shapes) > 200)):
            continue  # the eager per-parameter loop here only measures the host (and takes long)
        if "[foreach," in label and numel > (4 << 20):
            continue  # the foreach rounding runs a dozen int64 passes: seconds a step here
        if "torch.compile" in label and (len(shapes) > 200 or skip_compiled):
            continue  # compiling a step over thousands of tensors takes minutes
        entries.append((label, family, factory))
    if any("torch.compile" in label for label, _, _ in entries):
        # The compiled graphs of earlier sets are of no use here, and each compiled code
        # object may only recompile 8 times before dynamo runs it eagerly: start afresh.
        torch._dynamo.reset()
    # Interleaved when the parameters, gradients and every contender's state fit together.
    copies = 2 + sum(STATE_COPIES[family] for _, family, _ in entries)
    interleaved = fits_in_memory(4 * copies, numel, dtype, device)
    params = [torch.zeros(s, device=device, dtype=dtype).normal_().requires_grad_()
              for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2

    def start(label, family, factory):
        compiling = "torch.compile" in label
        progress.show(f"{name}: {'compiling' if compiling else 'warm-up'} {label}")
        try:
            opt = factory(params)
            for _ in range(3):  # warm-up: state allocation, compilation, caches
                opt.step()
            synchronize(device)
        except Exception as e:  # noqa: BLE001  (a contender that cannot run here is reported)
            return dict(label=label, family=family, error=f"{type(e).__name__}: {e}")
        return dict(label=label, family=family, opt=opt, times=[], host_times=[],
                    interleaved=interleaved,
                    state_bytes=sum(t.numel() * t.element_size() for st in opt.state.values()
                                    for t in st.values() if torch.is_tensor(t)))

    runs, copies = [], []
    probe = [dict(probe=copy_probe)] if copy_probe is not None else []
    if interleaved:
        runs = [start(*entry) for entry in entries]
        rotation = runs + probe
        for r in range(rounds):  # every contender once per round, the order reversed every
            # other round: no one always first
            for run in (rotation if r % 2 == 0 else rotation[::-1]):
                # named as it runs: a round of a large set can take seconds per contender
                progress.show(f"{name}: round {r + 1}/{rounds}, {run.get('label', 'copy')}")
                if "probe" in run:
                    copies.append(copy_probe.sample(steps_per_round))
                elif "opt" in run:
                    t, host = timed_steps(run["opt"], device, steps_per_round)
                    run["times"].append(t)
                    run["host_times"].append(host)
            progress.advance(f"{name}: round {r + 1}/{rounds}")
    else:
        for i, entry in enumerate(entries):
            run = start(*entry)
            if "opt" in run:
                progress.show(f"{name}: {rounds} rounds of {entry[0]}")
                for _ in range(rounds):
                    t, host = timed_steps(run["opt"], device, steps_per_round)
                    run["times"].append(t)
                    run["host_times"].append(host)
                    if probe:
                        copies.append(copy_probe.sample(steps_per_round))
                del run["opt"]  # free its state before the next contender
                if device == "cuda":
                    torch.cuda.empty_cache()
            runs.append(run)
        progress.advance(name, rounds)
    copy_gbps = copy_probe.gbps(statistics.median(copies)) if copies else None
    results = []
    for run in runs:
        row = dict(set=name, label=run["label"], family=run["family"], numel=numel,
                   tensors=len(shapes))
        if "error" in run:
            row["error"] = run["error"]
        else:
            t = statistics.median(run["times"])
            row.update(ms=t * 1e3, times_ms=[x * 1e3 for x in run["times"]],
                       host_ms=statistics.median(run["host_times"]) * 1e3,
                       gbps=bytes_per_element(run["label"], run["family"], dtype) * numel / t / 1e9,
                       state_bytes=run["state_bytes"], paired=run["interleaved"])
            if copy_gbps:
                row.update(copy_gbps=copy_gbps, copy_samples=len(copies))
        results.append(row)
        run.pop("opt", None)
    by_label = {r["label"]: r for r in results if "ms" in r}
    for r in results:
        if "ms" not in r:
            continue
        ref = by_label.get(f"{r['family']}[reference]")
        if ref:
            r["speedup_vs_reference"] = ref["ms"] / r["ms"]
        peer = by_label.get(PEERS.get(r["family"]))
        if peer:
            r.update(versus_peer(r, peer))
    return results


def versus_peer(row, peer):
    """Time and GB/s relative to torch's fused peer. Interleaved contenders are compared round
    by round (each round's two times were taken moments apart, so drift in the machine's speed
    cancels) and the median of those paired ratios is kept; otherwise the ratio of medians."""
    bytes_ratio = row["gbps"] * row["ms"] / (peer["gbps"] * peer["ms"])
    if row.get("paired") and peer.get("paired"):
        times = [a / b for a, b in zip(row["times_ms"], peer["times_ms"])]
        return dict(time_vs_torch_fused=statistics.median(times),
                    gbps_vs_torch_fused=statistics.median(bytes_ratio / t for t in times),
                    compared="median of paired per-round ratios")
    return dict(time_vs_torch_fused=row["ms"] / peer["ms"],
                gbps_vs_torch_fused=row["gbps"] / peer["gbps"], compared="ratio of medians")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                        default="float32")
    parser.add_argument("--sets", help=f"comma-separated, from {', '.join(SETS)}")
    parser.add_argument("--state-dtype", choices=list(STATE_NAMES),
                        help="add PNM/AdaPNM keeping their state in this dtype (state_dtype; "
                             "fused where its kernel keeps it, and foreach), beside the rest")
    parser.add_argument("--out", default=OUT, help="where the table, JSON and figure go "
                        "(default benchmarks/out/, which git ignores; the tables kept in the "
                        "tree are in benchmarks/results/)")
    parser.add_argument("--rounds", type=int, help="timed rounds per contender (default: 7 on "
                        "a CPU, 15 on a GPU, 3 with --quick)")
    parser.add_argument("--compiled", action="store_true",
                        help="add the torch.compile'd contenders (the reference and PNM/AdaPNM "
                             "in foreach ops compiled, torch's optimizers compiled) on sets of "
                             "at most 200 tensors: compiling them takes minutes on a CPU")
    parser.add_argument("--no-compiled", "--no-compiled-reference", action="store_false",
                        dest="compiled", help=argparse.SUPPRESS)  # the default now; kept for old commands
    parser.add_argument("--triton-configs", metavar="TUNE_JSON",
                        help="run the Triton backend with the best launch configurations of a "
                             "benchmarks/experiments/tune_triton.py run instead of the built-in table")
    parser.add_argument("--fused-chunk", type=int, metavar="ELEMENTS",
                        help="elements each block of the fused CUDA step updates (a multiple "
                             f"of 8; shipped {cuda_chunk_size(torch.float32)} for fp32, "
                             f"{cuda_chunk_size(torch.bfloat16)} for 16-bit types): to time "
                             "other launch shapes")
    args = parser.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    state_dtype = getattr(torch, args.state_dtype) if args.state_dtype else None
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    names = args.sets.split(",") if args.sets else (QUICK_SETS if args.quick else DEFAULT_SETS)[device]
    for n in names:
        if n not in SETS:
            parser.error(f"unknown set {n!r}; choose from {', '.join(SETS)}")
    rounds = args.rounds or (3 if args.quick else DEFAULT_ROUNDS[device])
    # On a GPU a round is timed with events, so more steps cost little and steady the small sets.
    steps_per_round = 2 if args.quick else (10 if device == "cuda" else 3)
    info = machine_info(device, args)
    info["dtype"] = args.dtype
    if state_dtype is not None:
        info["state_dtype"] = args.state_dtype
    if args.triton_configs:
        from pnm_kernels.backends.triton_kernels import set_launch_config
        configs = load_triton_configs(args.triton_configs)
        set_launch_config(configs)
        info["triton_configs"] = {
            f"{str(dt).removeprefix('torch.')}/{'AdaPNM' if ada else 'PNM'}": dataclasses.asdict(c)
            for (dt, ada), c in configs.items()}
    if args.fused_chunk:
        if args.fused_chunk <= 0 or args.fused_chunk % 8:
            parser.error(f"--fused-chunk: a positive multiple of 8, not {args.fused_chunk}")
        from pnm_kernels._ops import extension_error, set_launch_limits
        if extension_error() is not None:
            parser.error(f"--fused-chunk: the compiled extension is not built ({extension_error()})")
        set_launch_limits(chunk_size=args.fused_chunk)
        info["fused_chunk"] = args.fused_chunk
        info["fused_chunk_shipped"] = f"{cuda_chunk_size(dtype)} for {args.dtype}"
    copy_numel = (16 << 20) if args.quick else (64 << 20) if device == "cpu" else (256 << 20)
    copy_probe = CopyProbe(device, copy_numel)
    info["copy_mib"] = copy_numel * 4 >> 20
    progress = Progress(rounds * len(names))
    results = []
    # The compiled reference's graph breaks and recompile limit are expected (see the table's
    # note), not news: dynamo's warnings about them would fill the screen. Nor is inductor's
    # "No CUDA runtime is found" on a machine without a GPU, which made a compile look stuck.
    quiet = [logging.getLogger("torch._dynamo")] + (
        [logging.getLogger("torch.utils.cpp_extension")] if device == "cpu" else [])
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        for name in names:
            results += bench_set(name, SETS[name](), device, dtype, rounds, steps_per_round,
                                 progress, skip_compiled=not args.compiled, copy_probe=copy_probe,
                                 state_dtype=state_dtype)
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        del copy_probe
        if args.triton_configs:
            set_launch_config(None)
        if args.fused_chunk:
            set_launch_limits()
    copies = list(copy_summary(results).values())
    copy_gbps = statistics.median(copies) if copies else None
    table = write_table(results, info)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    tag = (f"{device}-{args.dtype}{'-' + args.state_dtype + '-state' if state_dtype else ''}"
           f"{'-quick' if args.quick else ''}")
    with open(os.path.join(args.out, f"bench_step-{tag}.json"), "w") as f:
        json.dump(dict(machine=info, copy_gbps=copy_gbps, copy_gbps_per_set=copy_summary(results),
                       dtype=args.dtype, results=results), f, indent=1)
    with open(os.path.join(args.out, f"bench_step-{tag}.md"), "w") as f:
        f.write(table + "\n")
    plot(results, info, os.path.join(args.out, f"bench_step-{tag}.png"))
    print(f"\nwrote {args.out}/bench_step-{tag}.{{json,md,png}}")


if __name__ == "__main__":
    main()
