"""`python -m tools.slurm submit --dry-run`: the sbatch script rendered from the user's own command line."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.troubleshooting import assert_documented
from tools import slurm


def dry_run(capsys, *args: str) -> str:
    slurm.main(["submit", "--dry-run", *args])
    return capsys.readouterr().out


def test_two_nodes_of_four_gpus(capsys, tmp_path):
    script = dry_run(
        capsys, "--nodes", "2", "--gpus-per-node", "4", "--time", "24:00:00", "--partition", "gpu",
        "--account", "proj42", "--sbatch", "mem=200G", "--setup", "module load cuda/12.4",
        "--", "fit", "--data.num_workers", "7", "--trainer.default_root_dir", str(tmp_path / "run"),
    )  # fmt: skip
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in (
        "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8", "--time=24:00:00",
        "--partition=gpu", "--account=proj42", "--signal=SIGUSR1@90", "--requeue", "--mem=200G",
        f"--output={tmp_path / 'run'}/slurm-%j.out",
    ):  # fmt: skip
        assert f"#SBATCH {option}" in lines, (option, script)
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun.endswith(
        f"fit --data.num_workers 7 --trainer.default_root_dir {tmp_path / 'run'} --trainer.num_nodes 2 "
        f"--trainer.devices 4 --trainer.accelerator gpu --trainer.default_root_dir {tmp_path / 'run'}"
    )
    assert lines.index("module load cuda/12.4") < lines.index(srun)
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_cpu_tasks_and_the_default_run_dir(capsys):
    script = dry_run(capsys, "--tasks-per-node", "2", "--", "fit")
    assert "#SBATCH --ntasks-per-node=2" in script and "--gpus-per-node" not in script
    assert "--cpus-per-task=1" in script and "--trainer.accelerator cpu" in script
    assert "runs/mnist/slurm-%j.out" in script  # configs/mnist.yaml's default_root_dir, made absolute


def test_auto_workers_need_the_cpus_per_task(capsys):
    with pytest.raises(SystemExit, match="data.num_workers auto takes the CPUs SLURM gives each task") as stopped:
        dry_run(capsys, "--tasks-per-node", "2", "--", "fit", "--data.num_workers", "auto")
    assert_documented(stopped.value.code, "slurm-submit")
    script = dry_run(capsys, "--tasks-per-node", "2", "--cpus-per-task", "8", "--", "fit", "--data.num_workers", "auto")
    assert "#SBATCH --cpus-per-task=8" in script and "--data.num_workers auto" in script


def test_a_job_that_would_fail_its_preflight_is_not_submitted(capsys):
    with pytest.raises(SystemExit) as stopped:
        dry_run(capsys, "--gpus-per-node", "4", "--", "fit", "--trainer.strategy", "dp")
    assert "nothing was submitted" in str(stopped.value.code) and "strategy dp" in str(stopped.value.code)
    assert_documented(stopped.value.code, "slurm-submit")
    problem = stopped.value.code.splitlines()[1]  # the preflight's problem, with the link of its own section
    assert problem.startswith("  - ") and " Help: " in problem, problem


@pytest.mark.parametrize(
    "args",
    [
        ["--tasks-per-node", "2"],  # no command after --
        ["--", "fit"],  # no processes per node
    ],
)
def test_a_submit_without_its_command_or_processes_is_one_line(capsys, args):
    with pytest.raises(SystemExit) as stopped:
        slurm.main(["submit", "--dry-run", *args])
    assert_documented(stopped.value.code, "slurm-submit")


def test_submit_without_sbatch_names_the_script(capsys, tmp_path, monkeypatch):
    """A machine without SLURM's commands (an empty PATH for the sbatch call): the script is written, not submitted."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    with pytest.raises(SystemExit) as stopped:
        slurm.main(["submit", "--tasks-per-node", "2", "--", "fit", "--trainer.default_root_dir", str(tmp_path)])
    assert_documented(stopped.value.code, "sbatch")
    (script,) = (tmp_path / "sbatch").glob("*.sh")
    assert str(script) in stopped.value.code
    assert "#SBATCH" not in capsys.readouterr().out


def test_the_command_and_the_layout_are_required(capsys):
    with pytest.raises(SystemExit, match="after `--`"):
        dry_run(capsys, "--gpus-per-node", "4")
    with pytest.raises(SystemExit, match="--tasks-per-node"):
        dry_run(capsys, "--", "fit")
