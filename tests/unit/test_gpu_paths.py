"""The GPU code paths' defects that a CPU can show (issue 13); the rest are in tests/gpu and `make gpu-check`."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

import app.strategies  # noqa: F401  (registers the strategy names)
from app.launch.preflight import build, machine_problems
from app.strategies.ddp_mp import DDPModelParallelStrategy, balance, split_units
from core.env import detect
from datamodules import MNISTDataModule
from datamodules.base import _mean_std, normalize
from modules import ImageClassifier, zoo
from tests.conftest import ROOT, fast_trainer, run_cli
from tools.parity import jobs
from tools.slurm import resolve_config


def _stage_of_parameters(net: nn.Module, stages: int) -> tuple[nn.Module, dict[int, int]]:
    parent, units = split_units(net, stages)
    stage_of = {}
    for unit, stage in zip(units, balance(units, stages), strict=True):
        for p in unit.parameters():
            stage_of[id(p)] = stage
    return parent, stage_of


def _structure(arch: str) -> nn.Module:
    """The network on the meta device: the structure is all that matters (no memory, no init; regnet_y_128gf on the
    CPU took 13 s). RegNet's constructor computes its block widths with tensors and reads them back
    (``BlockParams.from_init_params``): that computation runs on the CPU."""
    from torchvision.models.regnet import BlockParams

    widths = BlockParams.from_init_params.__func__

    def on_cpu(cls, *args, **kwargs):
        with torch.device("cpu"):
            return widths(cls, *args, **kwargs)

    with mock.patch.object(BlockParams, "from_init_params", classmethod(on_cpu)), torch.device("meta"):
        return zoo.build(arch, num_classes=1000, in_channels=3)


@pytest.mark.parametrize("arch", zoo.available())
def test_ddp_mp_never_cuts_a_block_that_combines_its_children(arch):
    """A residual block (BasicBlock, Bottleneck, MBConv, ...) adds its input to its output: it must sit on one GPU.

    Only ``nn.Sequential`` (its forward is its children in order) and the top-level network may span stages; any
    other module holding parameters on two stages would meet tensors of two devices in its forward.
    """
    net = _structure(arch)
    for stages in range(2, 9):
        parent, stage_of = _stage_of_parameters(net, stages)
        for name, module in net.named_modules():
            spanned = {stage_of[id(p)] for p in module.parameters() if id(p) in stage_of}
            if len(spanned) > 1:
                assert module is parent or isinstance(module, nn.Sequential), (
                    f"{arch}, {stages} stages: {name} ({type(module).__name__}) spans stages {sorted(spanned)}"
                )


def test_resnets_are_cut_between_residual_blocks_only():
    """The cases of the issue: resnet18 with 3 and 4 stages, resnet50 with 8 used to split a block."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    for arch, stages in (("resnet18", 3), ("resnet18", 4), ("resnet50", 8)):
        net = _structure(arch)
        _, stage_of = _stage_of_parameters(net, stages)
        blocks = [m for m in net.modules() if isinstance(m, BasicBlock | Bottleneck)]
        assert len(blocks) == {"resnet18": 8, "resnet50": 16}[arch]
        for block in blocks:
            assert len({stage_of[id(p)] for p in block.parameters()}) == 1
        assert set(stage_of.values()) == set(range(stages)), f"{arch}: every one of the {stages} GPUs gets a block"


class _CountHooks(Callback):
    def on_train_start(self, trainer, pl_module):
        self.during = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pl_module.modules())


def test_ddp_mp_removes_its_stage_hooks_at_teardown(mnist_dir, tmp_path):
    """After fit the stage hooks are gone: on a GPU they kept moving inputs to cuda:k after the model went back."""
    model = ImageClassifier(arch="mnist_cnn")
    counter = _CountHooks()
    trainer = fast_trainer(tmp_path, strategy="ddp_mp", callbacks=[counter], limit_train_batches=2, limit_val_batches=0)
    trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir), batch_size=16))
    units = len(split_units(model, 2)[1])
    assert counter.during == units + 1  # one input mover per placed block, one output mover on the network
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


def test_ddp_mp_process_group_is_not_bound_to_the_first_stage_gpu(monkeypatch):
    """Lightning binds NCCL to root_device (device_id=); a process driving 2 GPUs must leave it unbound.

    Only the arguments given to Lightning's process-group helper can be seen on a CPU; NCCL itself runs in
    tests/gpu/test_ddp_mp_gpu.py and in `make gpu-check`.
    """
    import app.strategies.ddp_mp as ddp_mp

    calls = []
    monkeypatch.setattr(ddp_mp, "init_dist_connection", lambda env, backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = DDPModelParallelStrategy(
        devices_per_process=2, parallel_devices=[torch.device("cuda", 0)], cluster_environment=LightningEnvironment()
    )
    assert strategy.stage_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy.setup_distributed()
    ((backend, kwargs),) = calls
    assert backend == "nccl" and "device_id" not in kwargs


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_bf16_true_trains_the_imagenet_config_on_cpu(tmp_path):
    """16-true/bf16-true: Lightning casts the (uint8) batch before on_after_batch_transfer; normalize() then made
    float32 images for bf16 weights and the first convolution failed."""
    run = tmp_path / "run"
    result = run_cli(
        "fit", "--config", "configs/imagenet.yaml", "--config", "configs/precision/bf16_true.yaml",
        "--data.synthetic", "true", "--data.synthetic_train_size", "8", "--data.synthetic_val_size", "4",
        "--data.batch_size", "2", "--data.image_size", "32", "--data.num_workers", "0", "--model.arch", "resnet18",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
        "--trainer.devices", "1", "--trainer.default_root_dir", str(run), "--trainer.logger", "false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(next(run.rglob("summary.json")).read_text())
    assert summary["steps"] == 3 and summary["precision"] == "bf16-true"


def test_imagenet_config_turns_on_cudnn_autotuning_and_tf32_matmuls_on_cuda_only():
    config = resolve_config(["fit", "--config", str(ROOT / "configs" / "imagenet.yaml")])
    assert config.trainer.benchmark is True
    assert config.model.float32_matmul_precision == "high"
    saved = torch.get_float32_matmul_precision()
    try:  # set when a run on CUDA starts (the plan says so: test_plan); a run on the CPU leaves torch's setting
        ImageClassifier(arch="mnist_cnn", float32_matmul_precision="high").setup("fit")
        assert torch.get_float32_matmul_precision() == saved
    finally:
        torch.set_float32_matmul_precision(saved)


def test_normalize_builds_its_statistics_once_per_device():
    """They were rebuilt from Python numbers every batch: a blocking host-to-device copy on a GPU."""
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    first = normalize(images)
    assert _mean_std(images.device)[0] is _mean_std(images.device)[0]
    assert torch.allclose(
        first[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225])
    )


@pytest.fixture
def gpu_config():
    return resolve_config(["fit", "--trainer.default_root_dir", "/tmp/gpu-paths-plan", "--trainer.accelerator", "gpu"])


def test_dp_with_compile_is_refused_before_anything_starts(gpu_config):
    """nn.Module.compile() binds the compiled forward to the master module: every DataParallel replica would run the
    master's weights on cuda:0."""
    config = gpu_config.clone()
    config.trainer.strategy, config.trainer.devices, config.model.compile = "dp", 2, True
    plan = build(config, launch=detect({}))
    (problem,) = machine_problems(plan, config, cuda_devices=2)
    assert problem.startswith("dp cannot run a compiled model") and "--trainer.strategy ddp" in problem
    config.model.compile = False
    assert machine_problems(build(config, launch=detect({})), config, cuda_devices=2) == []


def test_ddp_mp_plan_maps_each_process_to_its_gpus(gpu_config):
    config = gpu_config.clone()
    config.trainer.strategy, config.trainer.devices = "ddp_mp", 2
    plan = build(config, launch=detect({}))
    assert plan.devices_per_process == 2
    assert "node 0 this host: ranks 0-1 -> cuda:0-3 (2 per process)" in plan.render()


def test_parity_gives_ddp_mp_a_job_sized_for_its_gpus():
    """On 2+ GPUs ddp_mp needs devices_per_process GPUs per process: it gets its own torchrun job."""
    modes = ["ddp", "allreduce", "ddp_mp"]
    assert jobs(modes, nproc=4, gpus=4) == {4: ["ddp", "allreduce"], 2: ["ddp_mp"]}
    assert jobs(modes, nproc=2, gpus=2) == {2: ["ddp", "allreduce"], 1: ["ddp_mp"]}
    assert jobs(modes, nproc=2, gpus=0) == {2: modes}  # CPU: all stages on the CPU, one job
