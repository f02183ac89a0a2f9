"""The source distribution builds: it carries every file the extension's sources include."""
import re
import subprocess
import sys
import tarfile
from pathlib import Path

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
    assert "setup.py" in names and "README.md" in names
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
