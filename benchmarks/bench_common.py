"""What every benchmark script here shares: the parameter sets, the bytes model, the timers,
the copy bandwidth, the machine record and the Triton launch configurations a tuning run chose.
It imports no benchmark script, so any of them (bench_step.py, experiments/*) may import it.
"""
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pnm_kernels  # noqa: E402

# Bytes per element per step (fp32; scaled by the element size for other dtypes).
BYTES_PER_ELEMENT = {"PNM": 24, "AdaPNM": 40, "SGD-momentum": 20, "Adam-amsgrad": 36}
# State tensors per parameter tensor (amsgrad on).
STATE_COPIES = {"PNM": 2, "AdaPNM": 4, "SGD-momentum": 1, "Adam-amsgrad": 3}


def transformer_shapes(d=512, layers=6, vocab=8192, ff=4):
    """A GPT-style stack: ~23M parameters in ~75 tensors."""
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, ff * d), (ff * d,), (ff * d, d), (d,)]
    return shapes + [(d,), (d,)]


def gpt2_124m_shapes():
    return transformer_shapes(d=768, layers=12, vocab=50257)


def resnet50_shapes():
    """torchvision's ResNet-50: 25.6M parameters in 161 tensors (conv weights, BN, fc)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, in_ch, 1, 1), (4 * width,), (4 * width,)]
            in_ch = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def llama_1b_shapes():
    """A Llama-3.2-1B-style decoder: 1.24B parameters in 146 tensors (tied embeddings)."""
    d, layers, ff, kv, vocab = 2048, 16, 8192, 512, 128256
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (ff, d), (ff, d), (d, ff)]
    return shapes + [(d,)]


def small_tensors_shapes(n=2000):
    """2,000 small tensors (biases, norms, adapters): where launch and host overheads show."""
    return [((i * 37) % 1500 + 64,) for i in range(n)]


def tiny_tensors_shapes(n=2000):
    """2,000 tensors of 16 elements: the step is almost all host work (grouping, checks,
    argument conversion, launch), which is what a GPU step over many small tensors pays."""
    return [(16,)] * n


SETS = {
    "transformer": transformer_shapes,
    "small2000": small_tensors_shapes,
    "tiny2000": tiny_tensors_shapes,
    "gpt2-124m": gpt2_124m_shapes,
    "resnet50": resnet50_shapes,
    "llama-1b": llama_1b_shapes,
    **{f"flat{n}M": (lambda n=n: [(n << 20,)]) for n in (1, 4, 16, 64, 256, 1024)},
}
def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, numel, repeats=10):
    """Measured read+write bandwidth of a large device-to-device copy, in GB/s (CUDA events
    on a GPU, where a host clock around a millisecond copy would add its own overhead). Taken
    once, this varies between moments on a shared CPU (46 vs 75 GB/s seen): bench_step.py
    times a CopyProbe inside every round instead."""
    probe = CopyProbe(device, numel)
    return probe.gbps(statistics.median(probe.sample() for _ in range(repeats)))


class CopyProbe:
    """A large device-to-device copy to time beside the contenders, round by round, so the
    bandwidth a step is compared with is taken in the same moments as the step (the median
    over rounds is kept). On a CPU a plain copy_ also reads its destination before writing it
    (read for ownership), which the read+write count omits: a step whose buffers are all read
    then written (no such extra read) can then exceed 100 % of it."""

    def __init__(self, device, numel):
        self.device, self.numel = device, numel
        self.src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
        self.dst = torch.zeros_like(self.src)  # touched: no page faults inside the timed copies
        for _ in range(2):  # warm-up
            self.dst.copy_(self.src)
        synchronize(device)

    def sample(self, calls=1):
        """Seconds per copy over `calls` copies."""
        return timed(lambda: self.dst.copy_(self.src), self.device, calls)[0]

    def gbps(self, seconds):
        return 2 * self.numel * 4 / seconds / 1e9


def timed(fn, device, calls=1):
    """(seconds per call, host seconds per call) over `calls` calls of fn. On a GPU the first
    is measured with CUDA events and the second is the time the host took to issue the calls
    (what a step over many small tensors is bound by); on a CPU they are the same wall-clock
    time. On a GPU one untimed call runs first and the start event is queued behind it, as a
    training loop queues its step behind the backward pass: the GPU does not sit idle while
    the host issues the first timed call (a bias of host time / calls: 2-5 % of a 2^26-element
    bf16 step on an H200), yet a step bound by its host time still shows that time."""
    if device == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - t0
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / calls, host / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    return t, t


def timed_steps(opt, device, steps):
    """(seconds per step, host seconds per step) over `steps` optimizer steps."""
    return timed(opt.step, device, steps)


def machine_info(device, args):
    info = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                pnm_kernels=pnm_kernels.__version__, device=device,
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                               if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    return info


def load_triton_configs(path):
    """The best configurations of an experiments/tune_triton.py JSON, as
    pnm_kernels.backends.triton_kernels.set_launch_config takes them."""
    from pnm_kernels.backends.triton_kernels import LaunchConfig
    with open(path) as f:
        best = json.load(f)["best"]
    return {(getattr(torch, b["dtype"]), b["optimizer"] == "AdaPNM"):
            LaunchConfig(b["block"], b["iters"], b["num_warps"]) for b in best}
