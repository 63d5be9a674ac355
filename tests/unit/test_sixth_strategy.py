"""A sixth parallel mode needs one strategy file: registered under a new name with its layout (here the throwaway
``tests/unit/sixth_strategy.py``), it is in ``python -m tools.parity``'s default modes, the step-time benchmark, the
mid-epoch resume scenarios and the GPU check's fits, the preflight plan lays it out and checks the machine by its
layout, and the parity job trains it like one device, with no other edit."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from app.launch.preflight import build, machine_problems
from bench.parity_report import STEPS, scenarios
from core.env import detect
from tools.parity import compare, jobs, parser
from tools.slurm import resolve_config

TOL = 1e-5


@pytest.fixture
def sixth():
    """The mode's name, registered for the test only (the other tests' mode lists stay as they are)."""
    from tests.unit import sixth_strategy

    sixth_strategy.register()
    yield sixth_strategy.NAME
    StrategyRegistry.remove(sixth_strategy.NAME)


def test_the_parity_tool_compares_it_by_default(sixth):
    assert sixth in parser().parse_args([]).modes.split(",")
    assert jobs(["ddp", sixth], nproc=4, gpus=4) == {4: ["ddp"], 1: [sixth]}  # 3 GPUs per process: a job of its own
    assert jobs(["ddp", sixth], nproc=2, gpus=0) == {2: ["ddp", sixth]}  # on CPU every mode shares the job


def test_the_step_time_benchmark_times_it(sixth):
    from bench.step_time import timed_modes

    processes, compared_with, strategy = timed_modes()[f"app_{sixth}"]
    assert (processes, compared_with, strategy) == (2, ("app_ddp", "plain_ddp"), sixth)


def test_the_resume_scenarios_and_the_gpu_check_run_it(sixth):
    from bench.gpu_check import mode_fits
    from tools.resume_legs import scenarios as resume_scenarios

    assert resume_scenarios()[f"{sixth}_w0"] == (["--trainer.strategy", sixth], 0)
    (fit,) = [f for f in mode_fits() if f[0].startswith(f"mode {sixth} ")]
    strategy = "--trainer.strategy=tests.unit.sixth_strategy.SixthStrategy"
    assert fit[1] == [strategy, "--trainer.strategy.init_args.devices_per_process", "1"]


def test_the_preflight_plan_lays_it_out_from_its_layout(sixth, tmp_path):
    config = resolve_config(
        ["fit", "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", sixth, "--trainer.devices", "2",
         "--trainer.accelerator", "gpu"]
    )  # fmt: skip
    plan = build(config, launch=detect({}))
    assert plan.strategy == sixth and plan.world_size == 2 and plan.devices_per_process == 3
    assert "node 0 this host: ranks 0-1 -> cuda:0-5 (3 per process)" in plan.render()
    (problem,) = machine_problems(plan, config, cuda_devices=4)
    assert problem.startswith(f"{sixth}: trainer.devices counts processes, and 2 process(es) x devices_per_process 3")
    assert machine_problems(plan, config, cuda_devices=6) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_the_parity_job_trains_it_like_one_device(sixth, mnist_dir, tmp_path):
    plain = scenarios(mnist_dir)[0]
    scenario = {**plain, "name": "sixth", "modes": ["ddp", sixth], "imports": ["tests.unit.sixth_strategy"]}
    facts = compare([scenario], steps=STEPS, nproc=2, workdir=tmp_path, accelerator="cpu")["scenarios"]["sixth"]
    mine = facts["modes"][sixth]
    assert mine["steps"] == STEPS and mine["ranks_identical"], mine
    assert mine["max_diff_vs_single"] < TOL and mine["max_diff_vs_ddp"] < TOL, mine
    assert facts["modes"]["ddp"]["moved"] > 100 * TOL  # the comparison is not vacuous
