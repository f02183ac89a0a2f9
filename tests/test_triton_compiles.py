"""The Triton kernels compile for a Hopper GPU (sm_90) without one. Compiled mode has rules
the interpreter does not check (pointer types, float64 maths, constexpr use), so this runs
in a separate process without TRITON_INTERPRET, with the launch configurations shipped for
Hopper. fp32 storage gets 16-byte loads; the kernels of compressed state compile as launched."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

# With a GPU the kernels are compiled and run by the rest of the suite; this is for CI.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels")


def test_kernels_compile_for_sm90_with_16_byte_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_compile_check.py")
    done = subprocess.run([sys.executable, script, "fp32,bf16,fp16"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 20 and all(r["sm_90"] for r in report.values())
    for mode in ("PNM", "AdaPNM-amsgrad", "AdaPNM"):
        assert report[f"fp32-{mode}"]["v4_loads"], mode
    # The counter increment in the step launch: each program's ticket is a gpu-scope
    # acquire-release atomic taken after a barrier over all its warps (they read their
    # counters before it), so the last program increments the counters after every read.
    assert all(r["ticket_after_barrier"] for k, r in report.items() if "PNM" in k and "-" in k
               and not k.startswith(("state-", "int8-")))
    # The state kernels (triton_state_kernels.py) as launched: no FMA contraction, and int8's
    # rounding decisions from correctly rounded square roots and divisions.
    compressed = {k: r for k, r in report.items() if k.startswith(("state-", "int8-"))}
    assert len(compressed) == 10 and not any(r["fma"] for r in compressed.values())
    assert all(r["sqrt_rn"] and r["div_rn"] for k, r in compressed.items() if k.startswith("int8"))
