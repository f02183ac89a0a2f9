"""The source distribution builds: it carries every file the extension's sources include.
A build that cannot see torch (pip's default, isolated build) stops at once saying what to run."""
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def sdist_names(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                    "sdist", "--dist-dir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True,
                   env={"PNM_KERNELS_NO_CUDA": "1", "PATH": "/usr/bin:/bin"})
    (archive,) = tmp_path.glob("pnm_kernels-*.tar.gz")
    with tarfile.open(archive) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def test_sdist_holds_every_source_and_header_the_build_includes(tmp_path):
    names = sdist_names(tmp_path)
    assert {"setup.py", "pyproject.toml", "README.md"} <= names
    sources = sorted(ROOT.glob("csrc/*"))
    assert sources
    for path in sources:
        assert f"csrc/{path.name}" in names, f"{path.name} is missing from the sdist"
        for included in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
            assert f"csrc/{included}" in names, f"{path.name} includes {included}, not in the sdist"
    for module in sorted(ROOT.glob("pnm_kernels/*.py")):
        assert f"pnm_kernels/{module.name}" in names
    assert "pnm_kernels/py.typed" in names  # PEP 561: see the typing test below


def test_import_does_not_pull_in_torch_distributed_tensor():
    """`import pnm_kernels` stays cheap: DTensor support does not import
    torch.distributed.tensor (~0.3 s); a program with DTensors has imported it already."""
    code = "import sys, pnm_kernels; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_package_is_typed_for_type_checkers(tmp_path):
    """py.typed ships in the installed package (PEP 561; the sdist test checks the sdist), and
    the public signatures' hints resolve: a type checker reads them instead of treating the
    package as untyped."""
    import typing

    import torch

    from pnm_kernels import PNM, AdaPNM, available_backends

    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "lib")],
                   cwd=ROOT, check=True, capture_output=True,
                   env={"PNM_KERNELS_NO_CUDA": "1", "PATH": "/usr/bin:/bin"})
    assert (tmp_path / "lib" / "pnm_kernels" / "py.typed").is_file()
    pnm, adapnm = typing.get_type_hints(PNM.__init__), typing.get_type_hints(AdaPNM.__init__)
    assert pnm["betas"] == tuple[float, float]
    assert adapnm["betas"] == tuple[float, float, float]
    assert pnm["lr"] == adapnm["lr"] == float | torch.Tensor
    assert typing.get_type_hints(available_backends)["return"] == list[str]


# What pip's isolated build (and `python -m build`'s) looks like to setup.py: no torch.
BLOCK_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""
# The PEP 517 hook pip and build call first, in the project's directory.
FIRST_HOOK = "import setuptools.build_meta as b; print(b.get_requires_for_build_wheel())"


def run_first_hook(prelude=""):
    return subprocess.run([sys.executable, "-c", prelude + FIRST_HOOK], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PNM_KERNELS_NO_CUDA": "1", "PATH": "/usr/bin:/bin"})


def test_a_build_without_torch_stops_at_once_saying_what_to_run_instead():
    """`pip install .`, `pip install -e .` and `python -m build --wheel` build in an isolated
    environment by default, which has no torch (pyproject.toml does not ask for one: it would
    download the newest CUDA torch, gigabytes, and build an extension for that torch, not the
    installed one). setup.py's first hook then exits with one sentence naming the command."""
    done = run_first_hook(BLOCK_TORCH)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert message.count("\n") == 0 and message.startswith("pnm_kernels builds against your "
                                                            "installed torch")
    for command in ("pip install --no-build-isolation .", "python -m build --wheel --no-isolation"):
        assert f"`{command}`" in message


def test_with_the_installed_torch_in_sight_the_build_goes_on():
    done = run_first_hook()
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_build_does_not_ask_for_a_torch_of_its_own():
    """torch is a requirement of the installed package, never of its build: the build uses the
    torch in the environment (--no-build-isolation), whose C++ symbols the extension binds."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    assert not [r for r in build["requires"] if re.match(r"torch\b", r)]
