"""The benchmark script runs in --quick mode and writes a well-formed record (no timings are
judged here: figures belong to benchmarks, not tests)."""
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path[:0] = [BENCHMARKS, os.path.join(BENCHMARKS, "examples"),
                os.path.join(BENCHMARKS, "experiments")]
import bench_report  # noqa: E402
import bench_step  # noqa: E402
from compiled_peer import CompiledAdaPNM, CompiledPNM  # noqa: E402
from conftest import (DEVICE, NVCC, OPTIMIZERS, clone_params, make_params,  # noqa: E402
                      requires_extension, train)
from pnm_kernels import available_backends  # noqa: E402
from pnm_kernels._ops import extension_error  # noqa: E402


def test_quick_run_writes_table_json_and_png(tmp_path, capsys):
    bench_step.main(["--quick", "--device", "cpu", "--sets", "flat1M", "--rounds", "1",
                     "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_step-cpu-float32-quick.json").read_text())
    assert record["machine"]["device"] == "cpu" and record["copy_gbps"] > 0
    labels = {r["label"] for r in record["results"]}
    assert {"PNM[reference]", "AdaPNM[reference]", "torch.SGD-momentum[fused]",
            "torch.Adam-amsgrad[fused]"} <= labels
    for r in record["results"]:
        if "error" not in r:
            assert r["ms"] > 0 and r["gbps"] > 0 and r["numel"] == 1 << 20
    assert not [label for label in labels if "torch.compile" in label]  # opt-in: --compiled
    png = (tmp_path / "bench_step-cpu-float32-quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| set | optimizer |" in capsys.readouterr().out


@requires_extension
def test_state_dtype_adds_our_steps_with_that_state_and_counts_its_bytes(tmp_path):
    """--state-dtype bfloat16: PNM/AdaPNM with bfloat16 state beside the rest, their bytes per
    element those of 2-byte buffers (PNM 3 x 4 + 3 x 2 = 18, AdaPNM-AMSGrad 3 x 4 + 7 x 2 = 26)
    and their state half the bytes of float32 state."""
    bench_step.main(["--quick", "--device", "cpu", "--sets", "flat1M", "--rounds", "1",
                     "--state-dtype", "bfloat16", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_step-cpu-float32-bfloat16-state-quick.json").read_text())
    rows = {r["label"]: r for r in record["results"] if "error" not in r}
    for family, bytes_moved in (("PNM", 18), ("AdaPNM", 26)):
        ours, plain = rows[f"{family}[fused,bf16 state]"], rows[f"{family}[fused]"]
        assert ours["gbps"] * ours["ms"] / 1e3 == pytest.approx(bytes_moved * (1 << 20) / 1e9)
        assert ours["state_bytes"] < plain["state_bytes"] / 2 + 4096  # + seeds and counters
        assert f"{family}[foreach,bf16 state]" in rows
    assert (tmp_path / "bench_step-cpu-float32-bfloat16-state-quick.png").exists()


def test_the_copy_bandwidth_is_timed_in_every_round_and_kept_per_set(tmp_path):
    """The % of copy bandwidth divides by a copy timed beside the contenders in each round
    (the median of the set's rounds), not by one copy timed before the run."""
    bench_step.main(["--quick", "--device", "cpu", "--sets", "flat1M,small2000", "--rounds", "3",
                     "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_step-cpu-float32-quick.json").read_text())
    assert set(record["copy_gbps_per_set"]) == {"flat1M", "small2000"}
    for r in record["results"]:
        if "error" not in r:
            assert r["copy_samples"] == 3
            assert r["copy_gbps"] == record["copy_gbps_per_set"][r["set"]] > 0
    md = (tmp_path / "bench_step-cpu-float32-quick.md").read_text()
    assert "timed in every round, median per set" in md.splitlines()[0]


def test_the_default_output_folder_is_ignored_by_git(tmp_path):
    """The benchmark writes to benchmarks/out/: the tree stays clean after it (the tables kept in
    the tree, benchmarks/results/, change only when asked with --out)."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(BENCHMARKS, "..", ".git")):
        pytest.skip("not a git checkout")
    assert os.path.samefile(os.path.dirname(bench_step.OUT), BENCHMARKS)
    done = subprocess.run(["git", "check-ignore", "-q", os.path.join(bench_step.OUT,
                                                                      "bench_step-cpu-float32.png")],
                          cwd=BENCHMARKS)
    assert done.returncode == 0


def test_the_figure_gives_every_contender_a_style_and_draws_a_gpu_record(tmp_path):
    """Each contender's ratio to torch's fused step of its family, in two panels; every label
    the benchmark can produce maps to a style and a legend entry."""
    kinds = {k for k, _, _, _ in bench_report.KINDS}
    labels = [label for label, _, _ in bench_step.contenders("cuda", torch.float32)]
    labels += ["PNM[triton]", "AdaPNM[triton]", "pytorch_optimizer.PNM", "torch.AdamW-amsgrad[fused]",
               "torch.AdamW-amsgrad[foreach]", "PNM[reference+torch.compile]",
               "AdaPNM[user foreach+torch.compile]", "torch.Adam-amsgrad[foreach+torch.compile]",
               "PNM[triton,int8 state]", "AdaPNM[triton,bf16 state]", "torchao.AdamW8bit",
               "bitsandbytes.Adam8bit", "bitsandbytes.SGD8bit"]
    peers = set(bench_step.PEERS.values())
    assert {bench_report.kind_of(label) for label in labels if label not in peers} <= kinds
    results = []
    for name, numel in (("tiny2000", 32000), ("flat64M", 1 << 26)):
        for i, label in enumerate(labels):
            family = label.split("[")[0].removeprefix("torch.").removeprefix("pytorch_optimizer.")
            family = {"AdamW-amsgrad": "Adam-amsgrad", "torchao.AdamW8bit": "AdaPNM",
                      "bitsandbytes.Adam8bit": "AdaPNM",
                      "bitsandbytes.SGD8bit": "PNM"}.get(family, family)
            results.append(dict(set=name, label=label, family=family, numel=numel, tensors=2000,
                                ms=1.0, gbps=1.0, time_vs_torch_fused=0.2 + 0.3 * i))
    info = dict(device="cuda", gpu="Some GPU", cpu="x", threads=8, dtype="bfloat16",
                torch="2.14.1", triton="3.8.0", pnm_kernels="0.1.0", date="2026-11-27T06:00:00")
    bench_report.plot(results, info, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert bench_report.count(1 << 30) == "1.07B" and bench_report.count(32000) == "32K"


def test_ratios_to_torch_are_paired_round_by_round():
    """A machine that slows down between rounds slows both contenders of a round alike: the
    paired ratio sees through it; sequential runs fall back to the ratio of medians."""
    ours = dict(ms=2.0, gbps=12.0, times_ms=[1.2, 2.4, 9.6], paired=True)  # 24 bytes/element
    peer = dict(ms=4.0, gbps=5.0, times_ms=[1.0, 2.0, 8.0], paired=True)   # 20 bytes/element
    r = bench_step.versus_peer(ours, peer)
    assert r["time_vs_torch_fused"] == pytest.approx(1.2)
    assert r["gbps_vs_torch_fused"] == pytest.approx(1.0)
    r = bench_step.versus_peer(dict(ours, paired=False), peer)
    assert r["time_vs_torch_fused"] == pytest.approx(0.5) and r["compared"] == "ratio of medians"


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_the_compiled_peer_steps_like_the_reference_in_one_graph(name):
    """The [user foreach+torch.compile] rows time docs/design.md §1's maths: the peer compiled
    matches the reference, buffers included, over both parities, and its one graph takes the
    two momentum lists in either order (a recompile every other step would time the compiler)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    params = make_params([(7,), (3, 5), ()])
    ref_params = clone_params(params)
    peer_class = {"PNM": CompiledPNM, "AdaPNM": CompiledAdaPNM}[name]
    peer = peer_class(params, lr=1e-2, compile_backend=counter)
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, backend="reference")
    train(peer, params, 9)
    train(ref, ref_params, 9)
    assert counter.frame_count == 1
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach())
        for key, buffer in peer.state[p].items():
            torch.testing.assert_close(buffer, ref.state[r][key], msg=key)


def test_a_full_run_times_every_compiled_contender(tmp_path, capsys):
    """With --compiled: the compiled reference, the compiled foreach peer and torch's compiled
    optimizers each give a time, none an error row, and the progress line names each compile
    while it runs; dynamo's warnings, silenced while it runs, are back after."""
    dynamo_level = logging.getLogger("torch._dynamo").level
    bench_step.main(["--device", "cpu", "--sets", "flat1M", "--rounds", "1", "--compiled",
                     "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_step-cpu-float32.json").read_text())
    compiled = {r["label"]: r for r in record["results"] if "torch.compile" in r["label"]}
    assert set(compiled) == {f"{family}[{how}+torch.compile]" for family, how in [
        ("PNM", "reference"), ("AdaPNM", "reference"), ("PNM", "user foreach"),
        ("AdaPNM", "user foreach"), ("torch.SGD-momentum", "foreach"),
        ("torch.Adam-amsgrad", "foreach")]}
    assert all("error" not in r and r["ms"] > 0 for r in compiled.values()), compiled
    assert "[user foreach+torch.compile]:" in (tmp_path / "bench_step-cpu-float32.md").read_text()
    assert logging.getLogger("torch._dynamo").level == dynamo_level  # its warnings are back
    progress = capsys.readouterr().err
    for label in compiled:
        assert f"flat1M: compiling {label}"[:bench_step.Progress.WIDTH] in progress


@requires_extension
def test_the_fused_chunk_can_be_set_for_a_run_and_is_put_back(tmp_path, monkeypatch):
    """--fused-chunk times another launch shape of the fused CUDA step, says so in the table
    and its JSON, and leaves the shipped chunking behind it (4,096 fp32 elements a block)."""
    blocks = lambda numel: len(torch.ops.pnm_kernels._launch_plan([numel], 4)) // 3  # noqa: E731
    assert blocks(1 << 17) == 32
    during = []
    bench_set = bench_step.bench_set
    monkeypatch.setattr(bench_step, "bench_set",
                        lambda *a, **k: (during.append(blocks(1 << 17)), bench_set(*a, **k))[1])
    bench_step.main(["--device", "cpu", "--sets", "flat1M", "--rounds", "1", "--no-compiled",
                     "--fused-chunk", "65536", "--out", str(tmp_path)])
    assert during == [2]
    info = json.loads((tmp_path / "bench_step-cpu-float32.json").read_text())["machine"]
    assert info["fused_chunk"] == 65536
    md = (tmp_path / "bench_step-cpu-float32.md").read_text()
    assert "65536 elements a block (--fused-chunk; shipped: 4096 for float32)" in md
    assert blocks(1 << 17) == 32
    with pytest.raises(SystemExit):
        bench_step.main(["--device", "cpu", "--sets", "flat1M", "--fused-chunk", "1000001"])


def test_a_float64_run_times_the_fused_step_and_leaves_triton_out(tmp_path):
    """--dtype float64: the fused kernels' fp64 build against torch's fp64 fused steps; the
    Triton kernels take no float64, so no Triton contender is listed on any device."""
    bench_step.main(["--quick", "--device", "cpu", "--dtype", "float64", "--sets", "flat1M",
                     "--rounds", "1", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_step-cpu-float64-quick.json").read_text())
    rows = {r["label"]: r for r in record["results"]}
    for name in ("PNM", "AdaPNM"):
        assert rows[f"{name}[fused]"]["ms"] > 0
    assert not [label for label in rows if "triton" in label]
    labels = [label for label, _, _ in bench_step.contenders("cuda", torch.float64)]
    assert "PNM[fused]" in labels or "fused" not in available_backends("cuda")
    assert not [label for label in labels if "triton" in label]


def test_unknown_set_is_refused():
    with pytest.raises(SystemExit):
        bench_step.main(["--sets", "nonsense", "--device", "cpu"])


def test_noisy_labels_example_runs(tmp_path):
    pytest.importorskip("sklearn")
    import noisy_labels

    results = noisy_labels.main(["--seeds", "1", "--epochs", "2", "--out", str(tmp_path)])
    assert set(results) == {"SGD", "SGD-slow", "PNM"}
    for curves in results.values():
        assert len(curves[0]["test"]) == 2 and 0 <= curves[0]["memorised"][-1] <= 1
    assert (tmp_path / "noisy_labels.png").read_bytes()[:4] == b"\x89PNG"
    with_state = noisy_labels.main(["--seeds", "1", "--epochs", "1", "--optimizers", "PNM",
                                    "--state-dtypes", "none,bfloat16", "--out", str(tmp_path)])
    assert set(with_state) == {"PNM"}  # the bfloat16-state run is in the table
    table = (tmp_path / "noisy_labels.md").read_text()
    assert "| PNM (b0=3.0) | mean |" in table and "| PNM (b0=3.0), bfloat16 state | mean |" in table


@pytest.mark.skipif(not torch.cuda.is_available() and not hasattr(torch.cpu.Stream, "record_event"),
                    reason="this torch has no FSDP2 on the CPU (see tests/test_distributed.py)")
def test_gpt_fsdp2_example_runs_on_cpu(monkeypatch):
    """World size 1 over gloo, bf16 autocast, FSDP2; compile is exercised in test_compile."""
    import gpt_fsdp2

    monkeypatch.setenv("MASTER_PORT", str(29600 + os.getpid() % 1000))
    results = gpt_fsdp2.main(["--steps", "2", "--warmup", "1", "--layers", "1", "--dim", "32",
                              "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
                              "--no-compile"])
    assert set(results) == {"AdamW[fused]", "AdaPNM"}
    for tokens_per_s, loss, memory in results.values():
        assert tokens_per_s > 0 and loss == loss and memory is None  # memory: CUDA only
    monkeypatch.setenv("MASTER_PORT", str(29600 + (os.getpid() + 1) % 1000))
    with_state = gpt_fsdp2.main(["--steps", "2", "--warmup", "1", "--layers", "1", "--dim", "32",
                                 "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
                                 "--no-compile", "--state-dtype", "bfloat16"])
    assert with_state["AdaPNM"][1] == with_state["AdaPNM"][1]  # a finite loss
    monkeypatch.setenv("MASTER_PORT", str(29600 + (os.getpid() + 2) % 1000))
    in_backward = gpt_fsdp2.main(["--steps", "2", "--warmup", "1", "--layers", "1", "--dim", "32",
                                  "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
                                  "--no-compile", "--state-dtype", "int8", "--param-dtype",
                                  "bfloat16", "--step-in-backward", "--optimizers", "PNM,AdaPNM"])
    assert set(in_backward) == {"PNM", "AdaPNM"}
    assert all(loss == loss for _, loss, _ in in_backward.values())


def test_triton_tuning_script_times_every_candidate_and_feeds_its_best_to_the_benchmark(
        tmp_path):
    pytest.importorskip("triton")
    import bench_step
    import tune_triton
    from pnm_kernels.backends import triton_kernels

    out = tmp_path / "tune.json"
    tune_triton.main(["--numels", "3000,2000", "--repeats", "1", "--steps", "1",
                      "--dtypes", "float32", "--out", str(out)])
    tuned = json.loads(out.read_text())
    rows = tuned["rows"]
    # PNM and AdaPNM, both sizes, every candidate
    assert len(rows) == 2 * 2 * len(tune_triton.CANDIDATES)
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    best = {b["optimizer"]: b for b in tuned["best"]}
    for family, b in best.items():
        own = [r for r in rows if r["optimizer"] == family]
        worst = lambda cfg: min(r["copy_fraction"] for r in own  # noqa: E731
                                if (r["block"], r["iters"], r["num_warps"]) == cfg)
        configs = {(r["block"], r["iters"], r["num_warps"]) for r in own}
        assert worst((b["block"], b["iters"], b["num_warps"])) == max(map(worst, configs))

    bench_step.main(["--device", "cpu", "--sets", "small2000", "--rounds", "1",
                     "--no-compiled", "--triton-configs", str(out),
                     "--out", str(tmp_path)])
    info = json.loads((tmp_path / "bench_step-cpu-float32.json").read_text())["machine"]
    assert info["triton_configs"]["float32/PNM"]["block"] == best["PNM"]["block"]
    assert "Triton launch configurations" in (tmp_path / "bench_step-cpu-float32.md").read_text()
    assert triton_kernels._override is None  # the benchmark put the built-in table back


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the bare loops")
def test_cpu_floor_script_builds_the_bare_loops_and_times_them_beside_the_fused_steps(capsys):
    import cpu_floor
    cpu_floor.main(["--set", "flat", "--numel", "10000", "--rounds", "1"])
    out = capsys.readouterr().out
    for family in ("SGD-momentum", "PNM", "Adam-amsgrad", "AdaPNM"):
        assert f"| {family} | bare loop |" in out
    assert "| PNM | pnm_kernels fused |" in out and "| AdaPNM | pnm_kernels fused |" in out
    assert "AdaPNM ÷ Adam-amsgrad, effective GB/s: bare loop" in out


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_launch_argument_benchmark_builds_for_the_gpu_check(tmp_path):
    """benchmarks/experiments/launch_params.cu runs only on a lent GPU (gpu_check.sh); it must
    build."""
    import subprocess

    source = os.path.join(BENCHMARKS, "experiments", "launch_params.cu")
    done = subprocess.run([NVCC, "-O2", "-std=c++17", "-arch=sm_90", source, "-o",
                           str(tmp_path / "launch_params")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "launch_params").stat().st_size > 0


def test_triton_host_script_times_the_step_without_launching(capsys):
    pytest.importorskip("triton")
    if extension_error() is not None:
        pytest.skip("pnm_kernels._C is not built")
    import triton_host
    from pnm_kernels.backends import triton_kernels
    kernel = triton_kernels._step_kernel
    triton_host.main(["--tensors", "3", "--steps", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert [r.split(" | ")[1] for r in rows] == ["PNM", "AdaPNM"]
    assert triton_kernels._step_kernel is kernel  # the real kernels are back


def test_missing_gradients_script_prints_both_optimizers_for_each_fraction(capsys):
    """On the test device: gpu_check.sh runs this script on CUDA."""
    import missing_grads
    missing_grads.main(["--steps", "1", "--fractions", "0,0.5", "--device", DEVICE])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 0%", "| 50%",
                                                     "| 95%, always the same (frozen)"]
    assert all(float(r.split(" | ")[1]) > 0 and float(r.split(" | ")[2].rstrip(" |")) > 0
               for r in rows[1:])


@pytest.mark.parametrize("missing", ["0", "0.5"])
def test_dtensor_step_script_times_each_optimizer_and_leaves_no_process_group(capsys, missing):
    """On the test device: gpu_check.sh runs this script on CUDA (where it once asked
    torch.cuda.set_device for "cuda", which needs an index)."""
    import torch.distributed as dist

    import dtensor_step
    dtensor_step.main(["--layers", "3", "--steps", "1", "--device", DEVICE, "--missing", missing])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| AdaPNM fused", "| torch Adam-AMSGrad fused", "| torch Adam-AMSGrad foreach"]
    assert all(float(r.split(" | ")[1].rstrip(" |")) > 0 for r in rows[1:])
    assert not dist.is_initialized()


@requires_extension
def test_chunk_sweep_times_each_chunk_size_against_the_shipped_one_and_puts_it_back(tmp_path):
    """On the test device (gpu_check.sh runs it on CUDA; on a CPU it only checks the script):
    a row per set, dtype and optimizer, a time for each chunk size and the shipped one for the
    dtype as the ratios' baseline; the shipped chunking is in force again afterwards."""
    import chunk_sweep
    from pnm_kernels._ops import cuda_chunk_size

    blocks = lambda: len(torch.ops.pnm_kernels._launch_plan([1 << 16], 4)) // 3  # noqa: E731
    chunk_sweep.main(["--device", DEVICE, "--sets", "flat1M", "--dtypes", "float32,bfloat16",
                      "--chunks", "8192", "--rounds", "1", "--steps", "1", "--out", str(tmp_path)])
    assert blocks() == (1 << 16) // cuda_chunk_size(torch.float32)
    rows = json.loads((tmp_path / "chunk_sweep.json").read_text())["rows"]
    assert [(r["dtype"], r["optimizer"]) for r in rows] == [
        ("float32", "PNM"), ("float32", "AdaPNM"), ("bfloat16", "PNM"), ("bfloat16", "AdaPNM")]
    for r in rows:
        shipped = str(cuda_chunk_size(getattr(torch, r["dtype"])))
        assert r["vs_shipped"][shipped] == 1.0
        assert {"8192", "4096", "16384"} <= set(r["ms"]) and all(v > 0 for v in r["ms"].values())
    assert "| flat1M | bfloat16 | AdaPNM |" in (tmp_path / "chunk_sweep.md").read_text()
