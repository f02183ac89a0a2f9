"""Optimizer step throughput: PNM/AdaPNM on every available backend against torch.optim.

    python benchmarks/bench_step.py [--device cpu|cuda] [--quick]
                                    [--dtype float32|bfloat16|float16|float64]
                                    [--sets transformer,small2000,...] [--out DIR]

Every contender runs in this one process, interleaved round by round, warm-up excluded; the
figure kept is the median over rounds. Throughput is "effective GB/s": the minimum bytes the
algorithm must move (docs/design.md §2) times the parameter count, divided by the step time, also
shown as a fraction of this device's measured copy bandwidth. Ratios to torch's fused
optimizers are medians of per-round paired ratios, so slow drift in a shared machine's speed
cancels. Writes a Markdown table (also printed), a JSON with every figure and the machine, and
a PNG plot.
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
from pnm_kernels import PNM, AdaPNM, available_backends  # noqa: E402
from pnm_kernels._ops import cuda_chunk_size  # noqa: E402
from pnm_kernels.backends import TRITON_DTYPES  # noqa: E402
from bench_common import (BYTES_PER_ELEMENT, SETS, STATE_COPIES, copy_bandwidth,  # noqa: E402
                          load_triton_configs, machine_info, synchronize, timed_steps)
from compiled_peer import CompiledPNM, CompiledAdaPNM  # noqa: E402

DEFAULT_SETS = {"cpu": ["tiny2000", "small2000", "resnet50", "transformer", "flat1M", "flat16M",
                        "flat64M"],
                "cuda": ["tiny2000", "small2000", "resnet50", "transformer", "gpt2-124m", "llama-1b",
                         "flat1M", "flat4M", "flat16M", "flat64M", "flat256M", "flat1024M"]}
QUICK_SETS = {"cpu": ["small2000", "transformer"], "cuda": ["small2000", "transformer", "flat64M"]}


def contenders(device, dtype=torch.float32):
    """(label, family, factory(params)) for every optimizer compared."""
    out = []
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
    """A one-line progress bar on stderr."""

    def __init__(self, total):
        self.total, self.done, self.start = total, 0, time.time()

    def advance(self, label, count=1):
        self.done += count
        width = 30
        filled = int(width * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{time.time() - self.start:5.0f}s {label[:40]:<40}")
        sys.stderr.flush()
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
              skip_compiled=False):
    """Every contender on one parameter set. All contenders share the parameters and
    gradients (their values do not change the work) and run interleaved, round by round,
    when all their states fit in memory together; otherwise one after the other."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    if not fits_in_memory(12, numel, dtype, device):  # p, g, m, m_other, v, v_max (+ copies)
        progress.advance(f"{name}: skipped (memory)", rounds)
        return [dict(set=name, label="(all)", family="-", numel=numel, tensors=len(shapes),
                     error="skipped: does not fit in this device's memory")]
    entries = []
    for label, family, factory in contenders(device, dtype):
        if label.endswith("[reference]") and (numel > (64 << 20) or
                                              (device == "cuda" and len(shapes) > 200)):
            continue  # the eager per-parameter loop here only measures the host (and takes long)
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

    runs = []
    if interleaved:
        runs = [start(*entry) for entry in entries]
        for r in range(rounds):  # every contender once per round, the order reversed every
            for run in (runs if r % 2 == 0 else runs[::-1]):  # other round: no one always first
                if "opt" in run:
                    t, host = timed_steps(run["opt"], device, steps_per_round)
                    run["times"].append(t)
                    run["host_times"].append(host)
            progress.advance(name)
    else:
        for i, entry in enumerate(entries):
            run = start(*entry)
            if "opt" in run:
                for _ in range(rounds):
                    t, host = timed_steps(run["opt"], device, steps_per_round)
                    run["times"].append(t)
                    run["host_times"].append(host)
                del run["opt"]  # free its state before the next contender
                if device == "cuda":
                    torch.cuda.empty_cache()
            runs.append(run)
        progress.advance(name, rounds)
    results = []
    scale = torch.tensor([], dtype=dtype).element_size() / 4
    for run in runs:
        row = dict(set=name, label=run["label"], family=run["family"], numel=numel,
                   tensors=len(shapes))
        if "error" in run:
            row["error"] = run["error"]
        else:
            t = statistics.median(run["times"])
            row.update(ms=t * 1e3, times_ms=[x * 1e3 for x in run["times"]],
                       host_ms=statistics.median(run["host_times"]) * 1e3,
                       gbps=BYTES_PER_ELEMENT[run["family"]] * scale * numel / t / 1e9,
                       state_bytes=run["state_bytes"], paired=run["interleaved"])
        results.append(row)
        run.pop("opt", None)
    by_label = {r["label"]: r for r in results if "ms" in r}
    for r in results:
        if "ms" not in r:
            continue
        ref = by_label.get(f"{r['family']}[reference]")
        if ref:
            r["speedup_vs_reference"] = ref["ms"] / r["ms"]
        peer = by_label.get({"PNM": "torch.SGD-momentum[fused]",
                             "AdaPNM": "torch.Adam-amsgrad[fused]"}.get(r["family"]))
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


def write_table(results, copy_gbps, info):
    gpu = info["device"] == "cuda"  # there the host's time to issue a step is its own column
    lines = [f"Device: {info.get('gpu') or info['cpu']} ({info['device']}, {info['threads']} threads), "
             f"torch {info['torch']}, triton {info['triton']}; copy bandwidth {copy_gbps:.1f} GB/s",
             "", "| set | optimizer | ms/step |" + (" host ms/step |" if gpu else "") +
             " eff. GB/s | % of copy BW | vs reference | time vs torch fused | GB/s vs torch fused |"
             " state MiB |", "|---|---|---|" + ("---|" if gpu else "") + "---|---|---|---|---|---|"]
    if info.get("triton_configs"):  # not the built-in table: say which were used
        lines[1:1] = ["", "Triton launch configurations (--triton-configs): " + "; ".join(
            f"{k} {c['block']} x {c['iters']}, {c['num_warps']} warps"
            for k, c in info["triton_configs"].items())]
    if info.get("fused_chunk"):
        lines[1:1] = ["", f"Fused CUDA step: {info['fused_chunk']} elements a block "
                          f"(--fused-chunk; shipped: {info['fused_chunk_shipped']})"]
    fmt = lambda r, k, f: (f % r[k]) if k in r else "–"  # noqa: E731
    for r in results:
        if "error" in r:
            lines.append(f"| {r['set']} | {r['label']} | {r['error'][:70]} |||||||" + ("|" if gpu else ""))
            continue
        lines.append(f"| {r['set']} | {r['label']} | {r['ms']:.3f} | " +
                     (f"{r['host_ms']:.3f} | " if gpu else "") +
                     f"{r['gbps']:.1f} | "
                     f"{100 * r['gbps'] / copy_gbps:.0f}% | {fmt(r, 'speedup_vs_reference', '%.1fx')} | "
                     f"{fmt(r, 'time_vs_torch_fused', '%.2f')} | {fmt(r, 'gbps_vs_torch_fused', '%.2f')} | "
                     f"{r['state_bytes'] / 2**20:.0f} |")
    if any("torch.compile" in r["label"] for r in results):
        lines += ["", "[reference+torch.compile]: `torch.compile(opt.step)` over the per-parameter "
                  "reference; it breaks the graph at each parameter's host-side step count, "
                  "compiles per parameter, and runs the parameters past dynamo's recompile "
                  "limit (8) eagerly (its warnings are silenced here). "
                  "[user foreach+torch.compile]: PNM/AdaPNM in foreach ops, compiled "
                  "into one graph (benchmarks/compiled_peer.py). torch's "
                  "[foreach+torch.compile]: `torch.compile(opt.step)` over `foreach=True`."]
    return "\n".join(lines)


def plot(results, copy_gbps, info, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels = sorted({r["label"] for r in results if "gbps" in r})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "os^vD<>ph*"
    for i, label in enumerate(labels):
        ours = label.startswith(("PNM", "AdaPNM")) and "torch.compile" not in label
        kw = dict(color=colors[i % len(colors)], marker=markers[i // len(colors) % len(markers)])
        rows = [r for r in results if r["label"] == label and "gbps" in r]
        flat = sorted((r["numel"], r["gbps"]) for r in rows if r["set"].startswith("flat"))
        if flat:  # flat tensors of growing size: a line
            ax.plot([p[0] for p in flat], [p[1] for p in flat], "-" if ours else "--",
                    label=label, markersize=4, **kw)
        model = [r for r in rows if not r["set"].startswith("flat")]
        ax.scatter([r["numel"] for r in model], [r["gbps"] for r in model], s=28,
                   label=None if flat else label, **kw)
    for name in sorted({r["set"] for r in results if not r["set"].startswith("flat")}):
        xs = [r["numel"] for r in results if r["set"] == name]
        if xs:
            ax.annotate(name, (xs[0], 0), textcoords="offset points", xytext=(0, 4),
                        fontsize=7, rotation=90, color="gray")
    ax.axhline(copy_gbps, color="black", linestyle=":", label=f"copy bandwidth {copy_gbps:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (elements)")
    ax.set_ylabel("effective GB/s (lines: flat tensors; points: model-shaped sets)")
    ax.set_title(f"Optimizer step throughput on {info.get('gpu') or info['cpu']}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                        default="float32")
    parser.add_argument("--sets", help=f"comma-separated, from {', '.join(SETS)}")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--rounds", type=int, help="timed rounds per contender")
    parser.add_argument("--no-compiled", "--no-compiled-reference", action="store_true",
                        dest="no_compiled",
                        help="leave out the torch.compile'd contenders (compiling takes minutes)")
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
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    names = args.sets.split(",") if args.sets else (QUICK_SETS if args.quick else DEFAULT_SETS)[device]
    for n in names:
        if n not in SETS:
            parser.error(f"unknown set {n!r}; choose from {', '.join(SETS)}")
    rounds = args.rounds or (3 if args.quick else 15)
    # On a GPU a round is timed with events, so more steps cost little and steady the small sets.
    steps_per_round = 2 if args.quick else (10 if device == "cuda" else 3)
    info = machine_info(device, args)
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
    copy_gbps = copy_bandwidth(device, (16 << 20) if args.quick else (64 << 20) if device == "cpu"
                               else (256 << 20))
    progress = Progress(rounds * len(names))
    results = []
    # The compiled reference's graph breaks and recompile limit are expected (see the table's
    # note), not news: dynamo's warnings about them would fill the screen.
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)
    try:
        for name in names:
            results += bench_set(name, SETS[name](), device, dtype, rounds, steps_per_round,
                                 progress, skip_compiled=args.quick or args.no_compiled)
    finally:
        dynamo_log.setLevel(dynamo_level)
        if args.triton_configs:
            set_launch_config(None)
        if args.fused_chunk:
            set_launch_limits()
    table = write_table(results, copy_gbps, info)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    tag = f"{device}-{args.dtype}{'-quick' if args.quick else ''}"
    with open(os.path.join(args.out, f"bench_step-{tag}.json"), "w") as f:
        json.dump(dict(machine=info, copy_gbps=copy_gbps, dtype=args.dtype, results=results), f, indent=1)
    with open(os.path.join(args.out, f"bench_step-{tag}.md"), "w") as f:
        f.write(table + "\n")
    plot(results, copy_gbps, info, os.path.join(args.out, f"bench_step-{tag}.png"))
    print(f"\nwrote {args.out}/bench_step-{tag}.{{json,md,png}}")


if __name__ == "__main__":
    main()
