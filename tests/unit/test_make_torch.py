"""``make demo`` / ``make test`` take the PyTorch build as one variable, ``TORCH`` (cu130 by default, cu128, cu126,
cpu), and hand pip PyTorch's own wheel index for any other build than the default.

The machine the suite runs on reaches only PyPI, so the other builds are checked here by the commands ``make -n``
prints (what ``make`` would run), with a ``VENV`` of the test's own; the default install is the one ``make test``
itself runs, for real.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

PINS = dict(re.findall(r"^(torch|torchvision)==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M))


def make(venv: Path, *args: str, dry: bool = True) -> subprocess.CompletedProcess:
    command = ["make", *(["-n"] if dry else []), "--no-print-directory", "-C", str(ROOT), *args, f"VENV={venv}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_default_build_is_pypis_torch_installed_as_before(tmp_path):
    venv = tmp_path / ".venv"
    out = make(venv, "demo").stdout
    assert "download.pytorch.org" not in out and "uninstall" not in out
    lines = out.splitlines()
    assert f"{venv}/bin/python -m pip install -c constraints.txt -e '.[dev]'" in lines
    assert lines[-2:] == [f"touch {venv}/.installed-cu130", f"{venv}/bin/python cli.py fit --test_after_fit best"]


@pytest.mark.parametrize("build", ["cu126", "cu128", "cpu"])
def test_another_build_comes_from_pytorchs_own_index_before_the_project(tmp_path, build):
    venv = tmp_path / ".venv"
    lines = make(venv, "test", f"TORCH={build}").stdout.splitlines()
    index = f"--extra-index-url https://download.pytorch.org/whl/{build}"
    wanted = f"torch=={PINS['torch']}+{build} torchvision=={PINS['torchvision']}+{build}"
    (torch_line,) = [i for i, line in enumerate(lines) if index in line]
    assert lines[torch_line] == f"{venv}/bin/python -m pip install -c constraints.txt {index} {wanted}"
    project = lines.index(f"{venv}/bin/python -m pip install -c constraints.txt -e '.[dev]'")
    assert torch_line < project and f"touch {venv}/.installed-{build}" in lines


def test_the_venv_keeps_its_build_and_another_one_replaces_torch(tmp_path):
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / ".installed-cpu").touch()  # a venv made with TORCH=cpu, newer than setup.cfg and constraints.txt
    assert make(venv, "demo").stdout.splitlines() == [f"{venv}/bin/python cli.py fit --test_after_fit best"]
    lines = make(venv, "demo", "TORCH=cu130").stdout.splitlines()
    assert f"rm -f {venv}/.installed-cpu && {venv}/bin/python -m pip uninstall -y torch torchvision" in lines
    assert not [line for line in lines if "download.pytorch.org" in line]  # back to PyPI's, the default


def test_an_unknown_build_stops_before_anything_is_installed(tmp_path):
    venv = tmp_path / ".venv"
    done = make(venv, "venv", "TORCH=cu99", dry=False)
    assert done.returncode != 0 and "error: TORCH=cu99: one of cu130 cu128 cu126 cpu" in done.stdout
    assert not venv.exists()
