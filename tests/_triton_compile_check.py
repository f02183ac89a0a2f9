"""Compiles the Triton kernels for sm_90 (no GPU needed), each with the launch configuration
it ships with for Hopper, and prints a JSON report. Run in a process without TRITON_INTERPRET,
so that triton.jit builds compilable kernels."""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from internals import (triton_increment_steps_kernel, triton_launch_config,
                       triton_step_kernel)

TARGET = GPUTarget("cuda", 90, 32)
SIGNATURE = {
    "ptr_table": "*i64", "numels": "*i64", "step_table": "*i64", "chunk_tensor": "*i32",
    "chunk_start": "*i64", "n_tensors": "i32", "lr": "fp32", "lr_ptr": "*fp32",
    "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "blocks_done_ptr": "*i32",
    "b1_sq": "fp32",
    "one_minus_b1_sq": "fp32", "b2": "fp32", "one_minus_b2": "fp32", "log_b1": "fp32",
    "log_b2": "fp32", "pos_coef": "fp32", "neg_coef": "fp32", "inv_noise_norm": "fp32",
    "eps": "fp32", "weight_decay": "fp32", "grad_sign": "fp32",
}
DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hopper_config(dtype, adaptive):
    """The launch configuration the step uses on a Hopper GPU (read without one)."""
    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        return triton_launch_config(torch.device("cuda"), dtype, adaptive)
    finally:
        torch.cuda.get_device_capability = real


def compile_kernel(fn, signature, consts, num_warps):
    signature = dict(signature, **{k: "constexpr" for k in consts})
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    except TypeError:  # triton < 3.3 calls them constants
        source = ASTSource(fn=fn, signature=signature, constants=consts)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps})


def main():
    report = {}
    for dtype in sys.argv[1].split(","):
        for mode in ("PNM", "AdaPNM-amsgrad", "AdaPNM"):
            adaptive, amsgrad = mode != "PNM", mode == "AdaPNM-amsgrad"
            config = hopper_config(TORCH_DTYPES[dtype], adaptive)
            consts = dict(DTYPE=DTYPES[dtype], ADAPTIVE=adaptive, AMSGRAD=amsgrad,
                          DECOUPLED=not amsgrad, HAS_LR_TENSOR=adaptive,
                          HAS_GRAD_SCALE=adaptive, HAS_FOUND_INF=adaptive, BLOCK=config.block,
                          ITERS=config.iters, ALIGNED=True, COUNT_STEPS=True, INTERPRETED=False)
            ptx = compile_kernel(triton_step_kernel(), SIGNATURE, consts,
                                 config.num_warps).asm["ptx"]
            ticket = ptx.find("atom.global.gpu.acq_rel.add")
            report[f"{dtype}-{mode}"] = {"sm_90": ".target sm_90" in ptx,
                                         "v4_loads": "ld.global.v4" in ptx,
                                         "ticket_after_barrier": 0 <= ptx.find("bar.sync") < ticket}
    state_compile_report(report)
    ptx = compile_kernel(triton_increment_steps_kernel(),
                         {"step_table": "*i64", "n_tensors": "i32", "found_inf_ptr": "*fp32"},
                         dict(HAS_FOUND_INF=True, BLOCK=256), 4).asm["ptx"]
    report["increment"] = {"sm_90": ".target sm_90" in ptx}
    print(json.dumps(report))


STATE_SIGNATURE = dict(
    {k: v for k, v in SIGNATURE.items() if k not in ("chunk_tensor", "blocks_done_ptr")},
    seed_table="*i64", offsets="*i64", chunk_tensor="*i32")
# The kernels' parameter order: the signature dicts follow it.
STATE_ORDER = ["ptr_table", "numels", "step_table", "seed_table", "offsets", "chunk_tensor",
               "chunk_start", "n_tensors", "lr", "lr_ptr", "grad_scale_ptr", "found_inf_ptr",
               "b1_sq", "one_minus_b1_sq", "b2", "one_minus_b2", "log_b1", "log_b2",
               "pos_coef", "neg_coef", "inv_noise_norm", "eps", "weight_decay", "grad_sign"]
INT8_ORDER = ["ptr_table", "scale_table", "numels", "row_lengths", "step_table", "seed_table",
              "offsets", "chunk_tensor", "chunk_start", "n_tensors"] + STATE_ORDER[8:]


def state_compile_report(report):
    """The kernels of state in a dtype of its own and of int8 state (triton_state_kernels.py),
    compiled as launched: without FMA contraction. int8's rounding decisions take correctly
    rounded square roots and divisions."""
    from pnm_kernels.backends import triton_state_kernels as kernels

    types = dict(STATE_SIGNATURE, scale_table="*i64", row_lengths="*i64")
    cases = [("state", "fp32", tl.bfloat16, False), ("state", "bf16", tl.float32, True),
             ("state", "bf16", tl.bfloat16, True), ("int8", "fp32", None, False),
             ("int8", "bf16", None, True)]
    for kind, dtype, state_dtype, sr in cases:
        for mode in ("PNM", "AdaPNM-amsgrad"):
            adaptive = mode != "PNM"
            consts = dict(DTYPE=DTYPES[dtype], PARAM_SR=sr, ADAPTIVE=adaptive, AMSGRAD=adaptive,
                          DECOUPLED=True, HAS_LR_TENSOR=adaptive, HAS_GRAD_SCALE=adaptive,
                          HAS_FOUND_INF=adaptive, INTERPRETED=False)
            if kind == "state":
                fn, order = kernels._state_step_kernel, STATE_ORDER
                consts.update(STATE_DTYPE=state_dtype, BLOCK=1024, ITERS=4)
            else:
                fn, order = kernels._int8_step_kernel, INT8_ORDER
                consts.update(BLOCKS=16)
            signature = {k: types[k] for k in order}
            source_consts = dict(consts)
            signature = dict(signature, **{k: "constexpr" for k in source_consts})
            try:
                source = ASTSource(fn=fn, signature=signature, constexprs=source_consts)
            except TypeError:  # triton < 3.3 calls them constants
                source = ASTSource(fn=fn, signature=signature, constants=source_consts)
            ptx = triton.compile(source, target=TARGET,
                                 options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
            name = f"{kind}-{dtype}-{state_dtype or 'int8'}-{mode}"
            report[name] = {"sm_90": ".target sm_90" in ptx, "fma": "fma.rn.f32" in ptx,
                            "sqrt_rn": "sqrt.rn.f32" in ptx, "div_rn": "div.rn.f32" in ptx}


if __name__ == "__main__":
    main()
