"""The preflight plan: real configs parsed by the app's CLI, launcher variables as SLURM and torchrun set them."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from app.command import main
from app.launch.checks import launch_problems, machine_problems
from app.launch.plan import Plan
from app.launch.preflight import PreflightError, build
from core.env import detect, expand_nodelist, split_local_rank, torchrun_node_range
from tests.conftest import ROOT
from tools.slurm import resolve_config

SLURM_2x4 = {  # what srun gives rank 5 of `sbatch --nodes=2 --ntasks-per-node=4`
    "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
    "SLURM_JOB_NAME": "dptrain-imagenet", "MASTER_ADDR": "127.0.0.1",
}  # fmt: skip
TORCHRUN_2 = {
    "TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
}  # fmt: skip


@pytest.fixture(scope="module")
def config_of():
    """cli.py's resolved config for a command line (parsed, nothing instantiated)."""
    return lambda *args: resolve_config(["fit", "--trainer.default_root_dir", "/tmp/plan-test", *args])


def problems(config, env) -> list[str]:
    return build(config, launch=detect(env)).problems


def test_expand_nodelist():
    assert expand_nodelist("gpu[07-09,12],login1") == ["gpu07", "gpu08", "gpu09", "gpu12", "login1"]
    assert expand_nodelist("n1") == ["n1"] and expand_nodelist("n[1-2]") == ["n1", "n2"]


def test_consistent_slurm_job_has_no_problem_and_maps_ranks_to_hosts(config_of):
    config = config_of("--trainer.devices", "4", "--trainer.num_nodes", "2", "--trainer.accelerator", "gpu")
    plan = build(config, launch=detect(SLURM_2x4))
    assert plan.problems == []
    text = plan.render()
    assert "SLURM, job 4242" in text and "2 node(s) x 4 process(es) = world size 8" in text
    assert "node 1 gpu08: ranks 4-7 -> cuda:0-3" in text
    batch, lr = config.data.init_args.batch_size, config.model.optimizer.init_args.lr  # the default config's
    assert f"{batch} per device, global {8 * batch}" in text and f"lr           {lr}" in text


def test_imagenet_recipe_plan_states_the_linearly_scaled_lr(config_of):
    config = config_of(
        "--config", str(ROOT / "configs" / "imagenet.yaml"), "--trainer.devices", "4", "--trainer.num_nodes", "2",
        "--trainer.accelerator", "gpu", "--data.batch_size", "64",
    )  # fmt: skip
    text = build(config, launch=detect(SLURM_2x4)).render()
    # 64 per device x 8 processes = 512 images per step -> 0.1 per 256 becomes 0.2
    assert "64 per device, global 512" in text
    assert "0.2 = 0.1 per 256 images x global batch 512 (linear scaling)" in text


def test_tasks_per_node_must_equal_devices(config_of):
    (problem,) = problems(config_of("--trainer.devices", "1", "--trainer.num_nodes", "2"), SLURM_2x4)
    assert "--ntasks-per-node 4" in problem and "Fix: `--trainer.devices 4`" in problem


def test_nodes_must_equal_num_nodes(config_of):
    (problem,) = problems(config_of("--trainer.devices", "4"), SLURM_2x4)
    assert "--nodes 2" in problem and "trainer.num_nodes=1" in problem and "--trainer.num_nodes 2" in problem


def test_ntasks_without_ntasks_per_node(config_of):
    env = {k: v for k, v in SLURM_2x4.items() if k != "SLURM_NTASKS_PER_NODE"}
    found = problems(config_of("--trainer.devices", "4", "--trainer.num_nodes", "2"), env)
    assert any("--ntasks but without --ntasks-per-node" in p for p in found), found


def test_batch_script_without_srun(config_of):
    env = {k: v for k, v in SLURM_2x4.items() if k != "SLURM_STEP_ID"}
    found = problems(config_of("--trainer.devices", "4", "--trainer.num_nodes", "2"), env)
    assert any("srun python cli.py" in p for p in found), found


def test_dp_under_a_multi_task_launcher(config_of):
    config = config_of("--trainer.strategy", "dp", "--trainer.devices", "2")
    assert any("strategy dp drives every device of ONE node" in p for p in problems(config, TORCHRUN_2))
    assert problems(config, {}) == []  # one process driving the devices is what dp is for


def test_torchrun_nproc_per_node_must_equal_devices(config_of):
    (problem,) = problems(config_of("--trainer.devices", "1"), TORCHRUN_2)
    assert "--nproc_per_node 2" in problem and "--trainer.devices 2" in problem
    assert problems(config_of("--trainer.devices", "2"), TORCHRUN_2) == []


def test_elastic_torchrun_node_range_takes_the_world_from_the_launcher(config_of):
    """``torchrun --nnodes 1:2 --max-restarts 3`` started 1 node this round: trainer.num_nodes=2 is not a mistake."""
    env = {**TORCHRUN_2, "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}
    config = config_of("--trainer.devices", "2", "--trainer.num_nodes", "2", "--trainer.accelerator", "cpu")
    (problem,) = problems(config, env)  # a fixed --nnodes must match the config
    assert "(--nnodes 1) but trainer.num_nodes=2" in problem
    plan = build(config, launch=replace(detect(env), node_range=(1, 2)))
    assert plan.problems == [] and plan.num_nodes == 1 and plan.launched_world_size == 2
    text = plan.render()
    assert "torchrun, job abc (restart 1)" in text and "restart 1 of at most 3: when a worker dies" in text
    assert "--nnodes 1:2, 1 node(s) this round (world size from WORLD_SIZE)" in text
    assert "1 node(s) x 2 process(es) = world size 2" in text


@pytest.mark.parametrize(("nnodes", "expected"), [("1:2", (1, 2)), ("2", None), ("2:2", None)])
def test_the_node_range_is_read_from_the_agents_command_line(nnodes, expected):
    # a real process whose command line is a torchrun command, read through /proc as a worker reads its agent's
    torchrun_args = ["torch.distributed.run", "--nnodes", nnodes, "--nproc_per_node", "2", "cli.py", "fit"]
    waits = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"]
    agent = subprocess.Popen([*waits, *torchrun_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        agent.stdout.readline()  # its command line is readable once it runs (empty while exec is in progress)
        assert torchrun_node_range(agent.pid) == expected
    finally:
        agent.communicate(timeout=30)
    assert torchrun_node_range() is None  # pytest's parent is no torchrun agent


def test_rendezvous_host_that_does_not_resolve(config_of):
    env = {**SLURM_2x4, "SLURM_JOB_NODELIST": "no-such-host-l6[1-2]"}
    env.pop("MASTER_ADDR")
    (problem,) = problems(config_of("--trainer.devices", "4", "--trainer.num_nodes", "2"), env)
    assert "'no-such-host-l61'" in problem and "export MASTER_ADDR" in problem


def test_num_nodes_without_a_launcher_or_master_addr(config_of):
    (problem,) = problems(config_of("--trainer.num_nodes", "2"), {})
    assert "no launcher was detected" in problem and "torchrun --nnodes 2" in problem
    assert problems(config_of("--trainer.num_nodes", "2"), {"MASTER_ADDR": "10.0.0.1"}) == []


def test_global_batch_that_world_size_does_not_divide():
    plan = Plan(
        launch=detect(SLURM_2x4), strategy="ddp", accelerator="gpu", devices=4, num_nodes=2, batch_size=None,
        global_batch_size=1000, lr=0.1, precision="16-mixed", root_dir="/tmp", resume=None, timeout=None, accumulate=2,
    )  # fmt: skip
    (problem,) = launch_problems(plan)
    assert "global_batch_size=1000" in problem and "= 16" in problem and "992 or 1008" in problem


def test_the_cli_stops_every_rank_before_the_trainer_exists(monkeypatch, tmp_path):
    for key, value in SLURM_2x4.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(PreflightError) as stopped:
        main(["--trainer.default_root_dir", str(tmp_path), "--trainer.devices", "2", "--trainer.num_nodes", "2"], False)
    assert stopped.value.exit_code != 0 and "nothing was started" in str(stopped.value)
    assert "Fix: `--trainer.devices 4`" in str(stopped.value)
    assert not list(tmp_path.iterdir())


def test_sync_batchnorm_is_refused_for_dp_and_a_note_for_one_process(config_of):
    sync = ("--trainer.sync_batchnorm", "true")
    (problem,) = problems(config_of("--trainer.strategy", "dp", "--trainer.devices", "2", *sync), {})
    assert "torch's SyncBatchNorm does not support DataParallel" in problem and "--trainer.strategy ddp" in problem
    single = build(config_of("--trainer.devices", "1", *sync), launch=detect({}))
    assert single.problems == [] and any("sync_batchnorm has no effect in a single process" in n for n in single.notes)
    for strategy in ("ddp", "allreduce", "ddp_mp"):  # synchronised between the processes: neither problem nor note
        plan = build(config_of("--trainer.strategy", strategy, "--trainer.devices", "2", *sync), launch=detect({}))
        assert plan.problems == [] and not any("sync_batchnorm" in n for n in plan.notes), strategy


@pytest.mark.parametrize(
    "flag", [["--local-rank=1"], ["--local_rank=1"], ["--local_rank", "1"], ["--local-rank", "1"]]
)  # torch >= 2.0, older torch and DeepSpeed-style launchers
def test_torch_distributed_launch_local_rank_flag_is_taken_out(flag):
    assert split_local_rank(["cli.py", *flag, "fit", "--trainer.devices", "2"]) == (
        ["cli.py", "fit", "--trainer.devices", "2"],
        "1",
    )
    assert split_local_rank(["cli.py", "fit"]) == (["cli.py", "fit"], None)


def test_the_cli_accepts_local_rank_and_sets_local_rank_from_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "x")
    monkeypatch.delenv("LOCAL_RANK")  # absent now, and again after the test
    cli = main(["--local_rank", "0", "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"], False)
    assert cli.trainer.local_rank == 0
    assert os.environ["LOCAL_RANK"] == "0"  # what Lightning's cluster environments read


def test_deprecated_launcher_gets_a_note_with_the_torchrun_command(config_of):
    config = config_of("--trainer.devices", "2")
    # with --use-env there is no flag: the parent's command line (the launcher) tells
    parent = ["python", "-m", "torch.distributed.launch", "--use-env", "--nproc_per_node", "2", "cli.py", "fit"]
    launch = detect(TORCHRUN_2, argv=["cli.py", "fit"], parent=parent)
    plan = build(config, launch=launch)
    assert plan.problems == [] and "(started by python -m torch.distributed.launch, deprecated)" in plan.render()
    assert plan.notes[-1].endswith("The same job with torchrun: torchrun --nproc_per_node 2 cli.py fit")
    # the flag alone (no parent's command, e.g. not Linux): the command is rebuilt from the launcher's variables
    launch = detect(TORCHRUN_2, argv=["cli.py", "--local-rank=0", "fit"], parent=[])
    assert launch.legacy_launch == (
        "torchrun --nnodes=1 --nproc_per_node=2 --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 cli.py fit"
    )
    torchrun = ["python", "/venv/bin/torchrun", "--nproc_per_node", "2", "cli.py", "fit"]
    assert detect(TORCHRUN_2, argv=["cli.py", "fit"], parent=torchrun).legacy_launch is None
    assert "deprecated" not in build(config, launch=detect(TORCHRUN_2, argv=["cli.py"], parent=torchrun)).render()


def test_max_restarts_hands_a_one_node_multi_process_fit_to_the_agent_and_is_a_note_elsewhere(config_of):
    ddp2 = config_of("--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu")
    plan = build(ddp2, launch=detect({}), max_restarts=2)
    assert plan.by_agent and not plan.notes
    assert "launcher     torch's elastic agent, started by this process (--launch.max_restarts 2)" in plan.render()
    assert not build(ddp2, launch=detect({})).by_agent  # default 0: Lightning's launcher
    # a rank the agent started (torchrun's variables, its TORCHELASTIC_MAX_RESTARTS): in effect, nothing to say
    worker = build(ddp2, launch=detect({**TORCHRUN_2, "TORCHELASTIC_MAX_RESTARTS": "2"}), max_restarts=2)
    assert not worker.by_agent and not worker.notes and "restart 0 of at most 2" in worker.render()
    ignored = {
        "one process": build(config_of("--trainer.devices", "1"), launch=detect({}), max_restarts=2),
        "several nodes": build(
            config_of("--trainer.devices", "2", "--trainer.num_nodes", "2", "--trainer.accelerator", "cpu"),
            launch=detect({"MASTER_ADDR": "127.0.0.1"}),
            max_restarts=2,
        ),
        "its --max-restarts (0) applies": build(ddp2, launch=detect(TORCHRUN_2), max_restarts=2),
    }
    for why, plan in ignored.items():
        assert not plan.by_agent and any(
            n.startswith("--launch.max_restarts 2 ignored") and why in n for n in plan.notes
        ), (why, plan.notes)


def test_max_restarts_under_slurm_is_the_requeue_budget_of_the_app_or_of_the_batch_script(config_of):
    """Under SLURM, --launch.max_restarts is how many times a fault requeues the job: by the app in a batch script of
    the user's own, by the script of `tools.slurm submit` in its own (which tells the app so); the plan says which, and
    the rendered script requeues only while the job's recorded faults number at most K (and never twice)."""
    from tools.sbatch import Job

    config = config_of("--trainer.devices", "4", "--trainer.num_nodes", "2")
    plan = build(config, launch=detect({**SLURM_2x4, "SLURM_RESTART_COUNT": "1"}), max_restarts=2)
    (note,) = [n for n in plan.notes if n.startswith("--launch.max_restarts 2:")]
    assert "a fault requeues the job, done by the app (scontrol requeue), while the job's faults number at most 2 " \
        "(each recorded in the run dir's faults.jsonl; requeues by preemption or wall time do not count)" in note \
        and "needs --requeue" in note, note  # fmt: skip
    script = {**SLURM_2x4, "SLURM_RESTART_COUNT": "1", "DPTRAIN_REQUEUE_BY": "script"}  # tools.slurm's script
    plan = build(config, launch=detect(script), max_restarts=2)
    assert any("done by the batch script" in n for n in plan.notes), plan.notes
    script = Job(command=["fit"], max_restarts=2).render()
    assert "export DPTRAIN_REQUEUE_BY=script" in script
    assert 'if [ "$faults" -le 2 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert '[ "${restarts:-0}" -le "${SLURM_RESTART_COUNT:-0}" ]' in script  # a preemption's requeue is not repeated
    assert "scontrol requeue" not in Job(command=["fit"]).render()  # 0: the step's failure fails the job, as before


# what the NVIDIA kernel module of a 550 driver (CUDA 12.4's) writes to /proc/driver/nvidia/version
DRIVER_550 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize(
    ("driver", "expected"),
    [
        (DRIVER_550, "NVIDIA driver 550.54.15 is present but torch sees no GPU: "),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n", "runs on that driver"),
        (None, None),
    ],
    ids=["driver 550", "driver 580", "no driver"],
)
def test_a_driver_without_a_gpu_is_one_line_of_the_plan_and_stops_a_gpu_run(config_of, monkeypatch, tmp_path,
                                                                            driver, expected):  # fmt: skip
    version = tmp_path / "version"
    if driver is not None:
        version.write_text(driver)
    monkeypatch.setenv("DPTRAIN_NVIDIA_VERSION_FILE", str(version))  # the check reads this file, not the machine's
    plan = build(config_of(), launch=detect({}))
    assert machine_problems(plan, config_of(), cuda_devices=0) == []
    notes = [note for note in plan.notes if "NVIDIA driver" in note]
    if expected is None:
        assert notes == [] and "NVIDIA" not in plan.render()
        return
    (note,) = notes
    assert expected in note and f"note: {note}" in plan.render()
    if driver == DRIVER_550:  # this torch's CUDA needs a newer driver: the build that runs on this one, and how
        assert f"this torch is built for CUDA {torch.version.cuda}, which needs driver 580 or newer" in note
        assert "Fix: make venv TORCH=cu126 (PyTorch's CUDA 12.6 build), or update the driver." in note
    gpu = config_of("--trainer.accelerator", "gpu")
    (problem,) = machine_problems(build(gpu, launch=detect({})), gpu, cuda_devices=0)
    assert problem.startswith(note) and problem.endswith("#gpu-driver")


def test_the_imagenet_recipe_states_its_gpu_defaults_and_what_a_cuda_resume_guarantees(config_of):
    """The recipe's ``auto`` settings, resolved in the plan: the fast choice on CUDA, the portable one elsewhere;
    on CUDA also float32 matmuls and what a resume reproduces with and without determinism."""
    imagenet = ("--config", str(ROOT / "configs" / "imagenet.yaml"), "--data.synthetic", "true")
    gpu = build(config_of(*imagenet, "--trainer.accelerator", "gpu"), launch=detect({}))
    text = gpu.render()
    for line in ("memory       channels_last (NHWC) (model.channels_last auto: on CUDA)",
                 "compile      on (model.compile auto: on CUDA)", "/compile_cache (TORCHINDUCTOR_CACHE_DIR)",
                 "fp32 matmul  high (TF32 tensor cores)", "trainer.precision auto: on CUDA",
                 "resume       the same samples, order and augmentations, but not bit for bit"):  # fmt: skip
        assert line in text, text
    exact = build(config_of(*imagenet, "--trainer.accelerator", "gpu", "--trainer.deterministic", "true"),
                  launch=detect({})).render()  # fmt: skip
    assert "resume       exact: deterministic kernels (trainer.deterministic true)" in exact
    cpu = build(config_of(*imagenet, "--trainer.accelerator", "cpu"), launch=detect({}))
    assert cpu.precision == "32-true"
    text = cpu.render()
    assert (
        "precision    32-true (trainer.precision auto: not on CUDA)" in text
        and "NCHW (model.channels_last auto" in text
    )
    assert "fp32 matmul" not in text and "resume       " not in text and "compile_cache" not in text
    # dp's replicas (and ddp_mp's stages) do not run compiled models: auto leaves compile off there, and says why
    dp = build(config_of(*imagenet, "--trainer.accelerator", "gpu", "--trainer.strategy", "dp"), launch=detect({}))
    assert "compile      off, dp does not run compiled models (model.compile auto: on CUDA)" in dp.render()
    # a value given stays as given, and says so
    given = build(config_of(*imagenet, "--trainer.accelerator", "gpu", "--model.compile", "false"), launch=detect({}))
    assert "compile      off (model.compile)" in given.render()


def test_the_modern_recipe_states_its_average_mixing_sampler_and_weight_decay(config_of):
    """configs/imagenet_modern.yaml on 8 GPUs: 128 per device = the reference's global batch 1024 and lr 0.5, the
    average's decay as torchvision adjusts it (1 - 2e-5 x 1024 x 32 / 600), where each augmentation runs; the classic
    recipe states none of these lines."""
    modern = ("--config", str(ROOT / "configs" / "imagenet_modern.yaml"), "--trainer.devices", "8")
    text = build(config_of(*modern, "--trainer.accelerator", "gpu"), launch=detect({})).render()
    for line in (
        "batch        128 per device, global 1024", "lr           0.5 = 0.5 per 1024 images x global batch 1024",
        "ema          decay 0.998908 = torchvision's 0.99998 adjusted to global batch 1024 x 32 step(s) per update / "
        "600 epochs, restarted at each update of the 5 warm-up epochs",
        "validation, the best checkpoint and a test after fit use the average",
        "augment      TrivialAugmentWide, random erasing 0.1 per image: drawn in the loader workers (per sample), "
        "applied on the device after decoding, batched per operation (data.decode gpu)",
        "mixing       mixup 0.2 or cutmix 1 per batch, on the device, each device's share of the batch mixed within "
        "itself", "sampler      repeated augmentation x4",
        "evaluate     resize 232, centre crop 224; training crops 176",
        "weight decay 2e-05; 0 on normalisation layers (model.norm_weight_decay)",  # torchvision's: fc.bias decays
    ):  # fmt: skip
        assert line in text, (line, text)
    cpu = build(config_of(*modern, "--trainer.accelerator", "cpu", "--data.decode", "cpu"), launch=detect({}))
    assert "drawn in the loader workers (per sample), applied there" in cpu.render()
    classic = build(config_of("--config", str(ROOT / "configs" / "imagenet.yaml")), launch=detect({})).render()
    assert not [k for k in ("ema ", "mixing", "sampler", "augment", "evaluate", "weight decay") if f"  {k}" in classic]
