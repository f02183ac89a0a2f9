"""The report of a bench_step.py run: its Markdown table and its figure (each step's time over
torch's fused step, per set), and the names they give the contenders and their yardsticks.
It imports no other benchmark script (bench_step.py imports it)."""

# Each family's yardstick: torch's fused optimizer doing the same kind of step.
PEERS = {"PNM": "torch.SGD-momentum[fused]", "AdaPNM": "torch.Adam-amsgrad[fused]",
         "SGD-momentum": "torch.SGD-momentum[fused]", "Adam-amsgrad": "torch.Adam-amsgrad[fused]"}

# The low-bit peers beside int8 state, where they install (never dependencies): torchao's
# 8-bit AdamW and bitsandbytes' 8-bit Adam (no AMSGrad; AdaPNM's panel), bitsandbytes'
# 8-bit SGD with momentum (PNM's panel). Each keeps 8-bit moments with a float32 scale per
# 256 elements.
TORCHAO_ADAMW8BIT = "torchao.AdamW8bit"
BNB_ADAM8BIT = "bitsandbytes.Adam8bit"
BNB_SGD8BIT = "bitsandbytes.SGD8bit"


def copy_summary(results):
    """{set: median copy GB/s of its rounds} for the sets that timed the copy."""
    return {r["set"]: r["copy_gbps"] for r in results if r.get("copy_gbps")}


def write_table(results, info):
    gpu = info["device"] == "cuda"  # there the host's time to issue a step is its own column
    copies = copy_summary(results)
    low, high = (min(copies.values()), max(copies.values())) if copies else (0, 0)
    band = (f"{low:.1f} GB/s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}–{high:.1f} GB/s"
            ) if copies else "not measured"
    lines = [f"Device: {info.get('gpu') or info['cpu']} ({info['device']}, {info['threads']} threads), "
             f"torch {info['torch']}, triton {info['triton']}, {info.get('dtype', 'float32')}; "
             f"copy bandwidth {band} (a copy of {info.get('copy_mib', '?')} MiB timed in every "
             f"round, median per set)",
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
        share = f"{100 * r['gbps'] / r['copy_gbps']:.0f}%" if r.get("copy_gbps") else "–"
        lines.append(f"| {r['set']} | {r['label']} | {r['ms']:.3f} | " +
                     (f"{r['host_ms']:.3f} | " if gpu else "") +
                     f"{r['gbps']:.1f} | "
                     f"{share} | {fmt(r, 'speedup_vs_reference', '%.1fx')} | "
                     f"{fmt(r, 'time_vs_torch_fused', '%.2f')} | {fmt(r, 'gbps_vs_torch_fused', '%.2f')} | "
                     f"{r['state_bytes'] / 2**20:.0f} |")
    if not gpu and any(r.get("copy_gbps") and r["gbps"] > r["copy_gbps"] for r in results):
        lines += ["", "Above 100 % of copy bandwidth on a CPU: a plain copy also reads its "
                  "destination before writing it (read for ownership), which its read + write "
                  "count omits, while every buffer an optimizer writes it has read first; and part "
                  "of a small set stays in cache. Compare the ratios to torch, not percentages."]
    if any("torch.compile" in r["label"] for r in results):
        lines += ["", "[reference+torch.compile]: `torch.compile(opt.step)` over the per-parameter "
                  "reference; it breaks the graph at each parameter's host-side step count, "
                  "compiles per parameter, and runs the parameters past dynamo's recompile "
                  "limit (8) eagerly (its warnings are silenced here). "
                  "[user foreach+torch.compile]: PNM/AdaPNM in foreach ops, compiled "
                  "into one graph (benchmarks/compiled_peer.py). torch's "
                  "[foreach+torch.compile]: `torch.compile(opt.step)` over `foreach=True`."]
    return "\n".join(lines)


# The figure: one style per way of running a step, the same in both panels, with its legend
# entry. Ours (fused, Triton) first and drawn bold.
KINDS = [("fused", "tab:red", "o", "pnm_kernels fused"),
         ("fused,bf16 state", "darkred", "*", "pnm_kernels fused, bfloat16 state"),
         ("fused,fp32 state", "darkred", "*", "pnm_kernels fused, float32 state"),
         ("foreach,bf16 state", "peru", "s", "pnm_kernels foreach, bfloat16 state"),
         ("foreach,fp32 state", "peru", "s", "pnm_kernels foreach, float32 state"),
         ("fused,int8 state", "darkred", "v", "pnm_kernels fused, int8 state"),
         ("foreach,int8 state", "peru", "v", "pnm_kernels foreach, int8 state"),
         ("triton,bf16 state", "indigo", "*", "pnm_kernels Triton, bfloat16 state"),
         ("triton,fp32 state", "indigo", "*", "pnm_kernels Triton, float32 state"),
         ("triton,int8 state", "indigo", "v", "pnm_kernels Triton, int8 state"),
         ("triton", "tab:purple", "D", "pnm_kernels Triton"),
         ("foreach", "tab:orange", "s", "pnm_kernels foreach"),
         ("reference", "tab:brown", "v", "pnm_kernels reference (per parameter)"),
         ("reference+torch.compile", "tab:olive", "X", "reference + torch.compile"),
         ("user foreach+torch.compile", "tab:pink", "P", "PNM/AdaPNM in foreach ops + torch.compile"),
         ("pytorch_optimizer", "tab:cyan", "^", "pytorch_optimizer"),
         ("torchao", "tab:gray", "v", "torchao AdamW8bit (AdaPNM panel)"),
         ("bitsandbytes", "0.3", "^", "bitsandbytes Adam8bit / SGD8bit"),
         ("torch foreach", "tab:blue", "<", "torch foreach"),
         ("torch foreach+torch.compile", "tab:green", ">", "torch foreach + torch.compile"),
         ("torch AdamW fused", "tab:gray", "h", "torch AdamW fused (AdaPNM panel)"),
         ("torch AdamW foreach", "0.6", "H", "torch AdamW foreach (AdaPNM panel)")]


def kind_of(label):
    """"PNM[fused]" -> "fused", "torch.Adam-amsgrad[foreach]" -> "torch foreach", ..."""
    if label.startswith("pytorch_optimizer."):
        return "pytorch_optimizer"
    if label == TORCHAO_ADAMW8BIT:
        return "torchao"
    if label.startswith("bitsandbytes."):
        return "bitsandbytes"
    name, _, how = label.rstrip("]").partition("[")
    if name.startswith("torch.AdamW"):
        return f"torch AdamW {how}"
    return f"torch {how}" if name.startswith("torch.") else how


def count(n):
    """1,234,567 -> "1.23M" (elements)."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def plot(results, info, path):
    """Per set, each contender's step time over torch's fused step of its family (PNM: SGD
    with momentum, AdaPNM: Adam-AMSGrad), on a log axis; ours named on the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    sets = list(dict.fromkeys(r["set"] for r in results if "time_vs_torch_fused" in r))
    style = {k: (c, m) for k, c, m, _ in KINDS}
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 0.55 * max(len(sets), 1)), sharey=True,
                             squeeze=False)
    ratios = [r["time_vs_torch_fused"] for r in results if "time_vs_torch_fused" in r]
    lo, hi = min(ratios + [0.8]) / 1.3, max(ratios + [1.25]) * 1.3
    ticks = [2.0 ** k for k in range(-8, 9) if lo <= 2.0 ** k <= hi]
    shown = []
    for ax, family in zip(axes[0], ("PNM", "AdaPNM")):
        rows = [r for r in results if r.get("family") == family or
                (family == "AdaPNM" and r.get("family") == "Adam-amsgrad") or
                (family == "PNM" and r.get("family") == "SGD-momentum")]
        rows = [r for r in rows if "time_vs_torch_fused" in r and r["label"] != PEERS[family]]
        kinds = [k for k, _, _, _ in KINDS if any(kind_of(r["label"]) == k for r in rows)]
        ours = []
        for i, name in enumerate(sets):
            for j, kind in enumerate(kinds):  # each kind its own height within the set's row
                row = next((r for r in rows if r["set"] == name and kind_of(r["label"]) == kind), None)
                if row is None:
                    continue
                color, marker = style[kind]
                y = i + (j - (len(kinds) - 1) / 2) * 0.7 / max(len(kinds), 1)
                mine = kind.split(",")[0] in ("fused", "triton")
                ax.plot([1, row["time_vs_torch_fused"]], [y, y], color=color, lw=2 if mine else 0.8,
                        alpha=0.9 if mine else 0.5)
                ax.plot(row["time_vs_torch_fused"], y, marker=marker, color=color,
                        markersize=8 if mine else 6, markeredgecolor="black" if mine else color,
                        linestyle="none")
                if kind not in shown:
                    shown.append(kind)
            mine = [f"{k} {r['time_vs_torch_fused']:.2f}×" for k in
                    ("fused", "triton", "fused,bf16 state", "fused,fp32 state")
                    for r in rows if r["set"] == name and kind_of(r["label"]) == k]
            ours.append(" / ".join(mine) or "–")
        for i in range(len(sets) - 1):
            ax.axhline(i + 0.5, color="0.85", lw=0.8)
        ax.axvline(1, color="black", lw=1.2)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xticks(ticks, [f"{t:g}" if t >= 1 else f"1/{1 / t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel(f"step time ÷ {PEERS[family]} (log; < 1: faster)", fontsize=9)
        ax.set_title(f"{family}{'-AMSGrad' if family == 'AdaPNM' else ''} vs torch's fused "
                     f"{'SGD-momentum' if family == 'PNM' else 'Adam-AMSGrad'}", fontsize=10)
        right = ax.twinx()  # our steps' ratios, as text beside each row, off the data
        right.set_ylim(len(sets) - 0.5, -0.5)
        right.set_yticks(range(len(sets)), ours, fontsize=8)
        right.tick_params(length=0)
    first = axes[0][0]
    first.set_ylim(len(sets) - 0.5, -0.5)
    numel = {r["set"]: (r["numel"], r["tensors"]) for r in results}
    first.set_yticks(range(len(sets)), [f"{s}\n{numel[s][1]} tensor{'s' * (numel[s][1] > 1)}, "
                                        f"{count(numel[s][0])}" for s in sets], fontsize=8)
    info_line = (f"{info.get('gpu') or info['cpu']} ({info['device']}, {info['threads']} threads), "
                 f"{info.get('dtype', 'float32')}, torch {info['torch']}, triton {info['triton']}, "
                 f"pnm_kernels {info['pnm_kernels']}, {info['date'][:10]}")
    fig.suptitle(f"Optimizer step time relative to torch's fused optimizer, per parameter set\n"
                 f"{info_line}", fontsize=10)
    names = {k: name for k, _, _, name in KINDS}
    handles = [Line2D([], [], color=style[k][0], marker=style[k][1], linestyle="-",
                      markersize=8 if k.split(",")[0] in ("fused", "triton") else 6,
                      markeredgecolor="black" if k.split(",")[0] in ("fused", "triton")
                      else style[k][0],
                      label=names[k]) for k in names if k in shown]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(5, len(shown) or 1),
               fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
