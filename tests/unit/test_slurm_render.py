"""`python -m tools.slurm submit --dry-run`: the sbatch script rendered from the user's own command line."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess

import pytest
from jsonargparse import Namespace

from app.loggers import prepare_loggers
from core.env import detect
from tests.troubleshooting import assert_documented
from tests.wandb_reader import requires_wandb
from tools import grid, slurm
from tools.sbatch import Job


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


GRID = ["--grid", "model.optimizer.lr=0.1,0.01", "--grid", "data.batch_size=64,128"]


def test_a_grid_is_one_job_array_of_its_combinations(capsys, tmp_path):
    root = tmp_path / "grid"
    args = ["--tasks-per-node", "1", *GRID, "--", "fit", "--trainer.default_root_dir", str(root)]
    script = dry_run(capsys, "--max-parallel", "2", *args)
    lines = script.splitlines()
    assert "#SBATCH --array=0-3%2" in lines and f"#SBATCH --output={root}/slurm-%A_%a.out" in lines
    tasks = [line.strip() for line in lines if line.strip()[:3] in ("0) ", "1) ", "2) ", "3) ")]
    assert tasks == [  # the cartesian product, the last key changing fastest; each task in its own run folder
        f"{i}) task=(--model.optimizer.lr {lr} --data.batch_size {bs} --trainer.default_root_dir "
        f"{root}/lr={lr},batch_size={bs}) ;;"
        for i, (lr, bs) in enumerate([("0.1", "64"), ("0.1", "128"), ("0.01", "64"), ("0.01", "128")])
    ]
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun.endswith(f'--trainer.default_root_dir {root} "${{task[@]}}"')  # the task's folder comes last: wins
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --array=0-3" in dry_run(capsys, *args).splitlines()  # no %P without --max-parallel


def one_line_exit_2(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        dry_run(capsys, "--tasks-per-node", "1", *args)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "grid, said",
    [
        ("model.optimizer.lr=", "no empty value"),
        ("model.optimizer.lr=0.1,,0.2", "no empty value"),
        ("model.optimizer.lr", "needs KEY=V1,V2"),
        ("trainer.max_step=2,3", "did you mean --trainer.max_steps?"),  # the CLI's own check of the command
    ],
)
def test_a_grid_mistake_is_one_line(capsys, grid, said):
    assert said in one_line_exit_2(capsys, "--grid", grid, "--", "fit")
    assert "give it with a --grid" in one_line_exit_2(capsys, "--max-parallel", "2", "--", "fit")


def test_a_grid_larger_than_the_clusters_max_array_size_is_one_line(capsys, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'MaxArraySize            = 3'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    err = one_line_exit_2(capsys, *GRID, "--", "fit")
    assert "the grid has 4 tasks but this cluster's MaxArraySize is 3" in err
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    assert grid.max_array_size() == 1001  # no scontrol: SLURM's default


@requires_wandb
def test_an_array_tasks_wandb_run_is_in_the_arrays_group(tmp_path, monkeypatch):
    for name, value in {"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "3"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    logger = Namespace(class_path="app.loggers.WandbLogger", init_args=Namespace(group=None, id=None))
    config = Namespace(trainer=Namespace(logger=[logger], num_nodes=1, default_root_dir=str(tmp_path)), ckpt_path=None)
    prepare_loggers(config, "fit")
    assert logger.init_args.group == "slurm-array-4240"


def test_results_tabulates_each_tasks_run_folder(capsys, tmp_path, monkeypatch):
    job = Job(command=["fit"], run_dir=str(tmp_path), grid=[("model.optimizer.lr", ["0.1", "0.01", "0.001"])])
    grid.write_manifest(job, "77")
    done = tmp_path / "lr=0.1" / "version_0"
    done.mkdir(parents=True)
    (done / "events.out.tfevents.1000.host.1.0").touch()
    (done / "summary.json").write_text(json.dumps({"best val/acc1": 0.98765, "epochs": 2}))
    os.utime(done / "summary.json", (1042, 1042))
    bin_dir = tmp_path / "bin"  # squeue: task 1 still runs, task 2 left the queue unfinished
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho '1 RUNNING'\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    slurm.main(["results", str(tmp_path)])
    out = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(r["model.optimizer.lr"], r["epochs"], r["best val acc"], r["time_s"], r["state"]) for r in rows] == [
        ("0.1", "2", "0.9877", "42", "finished"), ("0.01", "", "", "", "running"), ("0.001", "", "", "", "failed"),
    ]  # fmt: skip
    assert "1 of 3 finished" in out and "lr=0.1" in out


def test_results_of_no_grid_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        slurm.main(["results", str(tmp_path / "nothing")])
    assert stopped.value.code == 2 and "no grid in" in capsys.readouterr().err


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
def test_an_array_task_shows_and_requeues_itself_alone(capsys):
    """One task's SLURM_JOB_ID is the array's, which scontrol takes for every task: ARRAYJOB_TASK names the task."""
    script = dry_run(capsys, "--tasks-per-node", "1", *GRID, "--", "fit", "--launch.max_restarts", "1")
    job = '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'
    assert f"scontrol requeue {job}" in script and f"scontrol show job {job}" in script
    tasks = {"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3"}
    said = subprocess.run(["bash", "-c", f"echo {job}"], env=tasks, capture_output=True, text=True)
    assert said.stdout.strip() == "5_3"
    assert detect({**tasks, "SLURM_NTASKS": "1"}).slurm_requeue_id == "5_3"  # the app's requeue, likewise
    assert detect({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"}).slurm_requeue_id == "5"
