"""What can be checked of the CUDA kernels without a GPU, beyond their emulated execution:
compiled for sm_90, every kernel moves data with 128-bit loads and stores, keeps its launch
table in parameter memory (no local-memory copy of the __grid_constant__ table), spills no
register and, but for fp64 AdaPNM-AMSGrad, leaves room for two blocks per SM (ptxas's own
report)."""
import os
import re
import subprocess
import sysconfig

import pytest
import torch
from conftest import NVCC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch has no CUDA headers")
def test_cuda_kernels_use_128_bit_accesses_and_no_local_memory(tmp_path):
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    ptx = tmp_path / "pnm_cuda.ptx"  # kept from the one compilation to machine code
    cmd = [NVCC, "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90", "-cubin",
           "-Xptxas", "-v", "--keep", f"--keep-dir={tmp_path}",
           f"-I{include}", f"-I{include}/torch/csrc/api/include",
           f"-I{sysconfig.get_paths()['include']}",
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
           os.path.join(ROOT, "csrc", "pnm_cuda.cu"), "-o", str(tmp_path / "pnm_cuda.cubin")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # ptxas -v: one "bytes stack frame, ... spill stores, ... spill loads" line per kernel.
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                        done.stdout + done.stderr)
    assert len(frames) >= 4 * 6 * 2 + 1, done.stderr[-3000:]
    assert all(f == ("0", "0", "0") for f in frames), frames
    # At most 64 registers a thread: an SM holds two 512-thread blocks of every step_kernel
    # (bf16 AdaPNM once took 104 and ran one block per SM). The single-launch kernels run one
    # block per SM anyway. fp64 AdaPNM-AMSGrad takes 72-74 and runs one block per SM: bound
    # to 64 (__launch_bounds__(512, 2)) it spilled, and an explicit bound on the others
    # changed their machine code; it must still fit one block (128).
    registers = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers",
                                done.stdout + done.stderr, re.S))
    many_block = {k: int(v) for k, v in registers.items()
                  if "step_kernel" in k and "single_launch" not in k}
    assert len(many_block) == 4 * 6, many_block
    one_block = {k for k in many_block if re.search(r"step_kernelIdNS_10AdaPnmAlgoILb[01]ELb1E", k)}
    assert len(one_block) == 2
    assert all(v <= (128 if k in one_block else 64) for k, v in many_block.items()), many_block
    text = ptx.read_text()
    kernels = re.split(r"\.entry ", text)[1:]
    step_kernels = [k for k in kernels if "step_kernel" in k.split("(")[0]]
    # fp32/fp64/fp16/bf16 x (PNM, AdaPNM) x modes, each as step_kernel and
    # single_launch_step_kernel; 128 bits are four 32-bit or two 64-bit elements
    assert len(step_kernels) == 4 * 6 * 2
    for body in step_kernels:
        assert re.search(r"ld\.global(\.nc)?\.(v4\.[a-z]32|v2\.[a-z]64)", body), body.split("(")[0]
        assert re.search(r"st\.global\.(v4\.[a-z]32|v2\.[a-z]64)", body), body.split("(")[0]
    assert "ld.local" not in text and "st.local" not in text
