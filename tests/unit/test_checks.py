"""Config and machine mistakes, run in-process as ``python cli.py fit ...`` would: each stops before anything is built
or written, with one message naming the cause and the fix."""

from __future__ import annotations

import sys

import pytest
import torch

from app.command import main
from app.launch.preflight import build, machine_problems
from core.env import detect
from tests.conftest import ROOT
from tests.troubleshooting import assert_documented
from tools.slurm import resolve_config


@pytest.fixture
def fit(tmp_path, capsys, monkeypatch):
    """Runs ``cli.py fit ARGS`` in this process; returns (exit code, what the user sees on stderr)."""
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when sys.argv holds pytest's arguments

    def run(*args: str, root=tmp_path / "run") -> tuple[int | str, str]:
        with pytest.raises(SystemExit) as stopped:
            main(["fit", "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", *args])
        code = stopped.value.code
        # a SystemExit carrying a message (PreflightError) is printed by Python at exit, with status 1
        seen = capsys.readouterr().err + (code if isinstance(code, str) else "")
        assert code not in (0, None)
        assert not list(root.glob("version_*")), "a run folder was started"
        return (1 if isinstance(code, str) else code), seen

    return run


def test_typo_in_an_option_is_refused_with_the_closest_option(fit):
    # before: argparse abbreviation silently took --trainer.max_epoch 3 for --trainer.max_epochs 3
    code, seen = fit("--trainer.max_epoch", "3")
    assert code == 2
    assert "error: unknown option --trainer.max_epoch (did you mean --trainer.max_epochs?)" in seen
    assert "usage:" not in seen and len(seen.strip().splitlines()) == 1


def test_typo_in_the_subcommand(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    with pytest.raises(SystemExit) as stopped:
        main(["fitt"])
    assert stopped.value.code == 2
    assert "error: unknown subcommand 'fitt' (did you mean fit?); one of fit, validate, test, predict" in (
        capsys.readouterr().err
    )


def test_typo_in_a_config_file_key(fit, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  max_epoch: 3\n")
    code, seen = fit("--config", str(config))
    assert code == 2
    assert "unknown key trainer.max_epoch in a config file (did you mean trainer.max_epochs?)" in seen


def test_unknown_precision_lists_the_valid_ones(fit):
    code, seen = fit("--trainer.precision", "16-mix")
    assert code == 2
    assert "trainer.precision='16-mix' is not valid (did you mean 16-mixed?)" in seen
    assert "bf16-mixed" in seen and "32-true" in seen and "Subtypes" not in seen


def test_unknown_strategy_lists_the_registered_ones(fit):
    _, seen = fit("--trainer.strategy", "ddpp")
    assert "trainer.strategy 'ddpp' is not a registered strategy (did you mean ddp?)" in seen
    assert all(name in seen for name in ("dp", "allreduce", "ddp_mp"))


def test_unknown_arch_suggests_the_closest_and_lists_all(fit):
    _, seen = fit("--model.arch", "resnet19")
    assert "error: Unknown model.arch 'resnet19'. Fix: --model.arch resnet18" in seen
    assert "mnist_cnn" in seen and "vit_b_16" in seen and "Traceback" not in seen


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data.batch_size", "0"], ["data.batch_size=0", "Fix: e.g. --data.batch_size 64"]),
        (["--data.batch_size", "x"], ["data.batch_size='x' is not valid", "int"]),
        (
            ["--data.global_batch_size", "100", "--trainer.devices", "3", "--trainer.strategy", "ddp"],
            ["data.global_batch_size=100 does not split evenly over world size 3", "e.g. 99 or 102"],
        ),
        (["--trainer.accelerator", "gpuu"], ["trainer.accelerator 'gpuu' is unknown (did you mean gpu?)"]),
        (["--data.num_workers", "-1"], ["data.num_workers=-1", "Fix: --data.num_workers 0", "or auto"]),
        (["--data.num_workers", "x"], ["data.num_workers='x' is not valid. Valid: a number or auto."]),
    ],
    ids=[
        "batch-size-0",
        "batch-size-not-a-number",
        "global-batch-not-divisible",
        "accelerator-typo",
        "workers-negative",
        "workers-not-a-number",
    ],
)
def test_impossible_numbers_and_names(fit, args, expected):
    _, seen = fit(*args)
    assert all(text in seen for text in expected), seen


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nccl"], "process_group_backend nccl needs CUDA GPUs, and this run is on the CPU. Fix: "),
        (["ncl"], "process_group_backend 'ncl' is not a torch.distributed backend (did you mean nccl?). Fix: "),
    ],
    ids=["nccl-on-cpu", "backend-typo"],
)
def test_process_group_backend_this_run_cannot_use(fit, args, expected):
    ddp = str(ROOT / "configs" / "strategy" / "ddp.yaml")
    _, seen = fit("--config", ddp, "--trainer.strategy.process_group_backend", *args)
    assert expected in seen and "--trainer.strategy.process_group_backend gloo on CPUs or nccl on GPUs" in seen


def test_options_of_a_strategy_name_ask_for_its_class(fit):
    code, seen = fit("--trainer.strategy", "allreduce_fp16", "--trainer.strategy.process_group_backend", "gloo")
    assert code == 2 and "trainer.strategy is the name 'allreduce_fp16', which takes no options" in seen
    fix = "--trainer.strategy AllReduceStrategy --trainer.strategy.compression fp16 --trainer.strategy.process_group"
    assert fix in seen


def test_horovod_strategy_points_to_allreduce(fit):
    _, seen = fit("--trainer.strategy", "horovod")
    assert "'horovod' is not a registered strategy (Lightning 2 has no Horovod; allreduce does what" in seen


def test_more_gpus_than_the_machine_has(fit):
    have = torch.cuda.device_count()
    _, seen = fit("--trainer.accelerator", "gpu", "--trainer.devices", str(have + 1))
    assert f"trainer.accelerator gpu asks for {have + 1} GPU(s) per node but this machine has {have}" in seen
    assert "--trainer.accelerator cpu" in seen and "MisconfigurationException" not in seen


def test_output_folder_that_cannot_be_written_is_found_before_training(fit, tmp_path):
    # a path below a regular file cannot be created, not even by root (chmod would not stop root)
    (tmp_path / "file").write_text("not a folder")
    _, seen = fit(root=tmp_path / "file" / "sub")
    assert f"trainer.default_root_dir {tmp_path / 'file' / 'sub'} is not writable" in seen
    assert f"{tmp_path / 'file'} is a file" in seen and "Fix: --trainer.default_root_dir" in seen


def test_sync_batchnorm_with_dp_stops_with_the_reason_and_the_fix(fit):
    code, seen = fit("--trainer.strategy", "dp", "--trainer.sync_batchnorm", "true")
    assert code == 1 and "does not support DataParallel" in seen and "Fix: --trainer.strategy ddp" in seen


def test_dp_under_a_multi_process_launcher_stops_every_rank(fit, monkeypatch):
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for key, value in {**torchrun, "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    _, seen = fit("--trainer.strategy", "dp", "--trainer.devices", "2")
    assert "strategy dp drives every device of ONE node from ONE process, but torchrun started 2 processes" in seen
    assert "torchrun --nproc_per_node=1" in seen and "--trainer.strategy ddp" in seen


@pytest.fixture(scope="module")
def ddp_mp_config():
    """cli.py's parsed config for ``--config configs/strategy/ddp_mp.yaml --trainer.accelerator gpu`` (parsed once)."""
    from tests.conftest import ROOT

    fragment = str(ROOT / "configs" / "strategy" / "ddp_mp.yaml")
    return resolve_config(["fit", "--trainer.default_root_dir", "/tmp/bad-input-plan", "--config", fragment,
                           "--trainer.accelerator", "gpu"])  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "gpus", "expected"),
    [
        (4, 4, "4 process(es) x devices_per_process 2 = 8 GPUs per node, but this machine has 4. "
               "Fix: --trainer.devices 2"),
        (1, 1, "1 process(es) x devices_per_process 2 = 2 GPUs per node, but this machine has 1. "
               "Fix: --trainer.accelerator cpu"),
    ],
)  # fmt: skip
def test_ddp_mp_needs_devices_times_devices_per_process_gpus(ddp_mp_config, devices, gpus, expected):
    """The GPU count is an argument: the check runs on this CPU machine as it would on a GPU node."""
    ddp_mp_config.trainer.devices = devices
    plan = build(ddp_mp_config, launch=detect({}))
    assert plan.strategy == "ddp_mp"
    (problem,) = machine_problems(plan, ddp_mp_config, cuda_devices=gpus)
    assert problem.startswith("ddp_mp: trainer.devices counts processes") and expected in problem
    if devices == 4:  # the line docs/troubleshooting.md quotes, as the preflight prints it
        assert_documented(f"  - {problem}", "ddp-mp-gpus")  # the check gave its line its own section's link


def test_ddp_mp_that_fits_leaves_no_problem_and_notes_idle_gpus(ddp_mp_config):
    ddp_mp_config.trainer.devices = 1
    plan = build(ddp_mp_config, launch=detect({}))
    assert machine_problems(plan, ddp_mp_config, cuda_devices=3) == []
    assert any("3 GPUs do not divide by devices_per_process 2" in note for note in plan.notes)


def test_fp16_mixed_on_cpu_stops_with_the_fix(ddp_mp_config):
    """Lightning would warn and quietly train bf16-mixed; the preflight stops and names the fix instead."""
    config = ddp_mp_config.clone()
    config.trainer.precision, config.trainer.accelerator = "16-mixed", "cpu"
    plan = build(config, launch=detect({}))
    (problem,) = machine_problems(plan, config, cuda_devices=0)
    assert "precision 16-mixed (fp16 AMP with loss scaling) needs a CUDA GPU" in problem
    assert "--trainer.precision bf16-mixed" in problem
    config.trainer.accelerator = "gpu"
    assert machine_problems(build(config, launch=detect({})), config, cuda_devices=8) == []


def test_auto_accelerator_on_a_machine_with_fewer_gpus_than_devices(ddp_mp_config):
    """``auto`` picks the GPUs when there are some; 4 devices on a 1-GPU node is then the same mistake as ``gpu``."""
    config = ddp_mp_config.clone()
    config.trainer.strategy, config.trainer.accelerator, config.trainer.devices = "ddp", "auto", 4
    plan = build(config, launch=detect({}))
    (problem,) = machine_problems(plan, config, cuda_devices=1)
    assert "trainer.accelerator auto asks for 4 GPU(s) per node but this machine has 1" in problem
    assert "Fix: --trainer.devices 1, or --trainer.accelerator cpu" in problem
    assert machine_problems(plan, config, cuda_devices=0) == []  # no GPU: auto means 4 CPU processes
