"""The strategies in one process: names, argument checks, bucketing, the model split, and dp's CPU code path."""

import logging
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.strategies import DDPStrategy

from app.command import main
from app.strategies import AllReduceStrategy, DataParallelStrategy, DDPModelParallelStrategy
from app.strategies.ddp_mp import balance, split_units
from core.errors import InvalidValue, UserError
from core.layout import layout_of
from datamodules import MNISTDataModule
from modules import ImageClassifier
from modules.zoo import build
from tests.conftest import fast_trainer, short_fit


@pytest.mark.parametrize(
    ("name", "cls", "attributes"),
    [
        ("dp", DataParallelStrategy, {}),
        ("allreduce", AllReduceStrategy, {"bucket_cap_mb": 25.0, "overlap": False, "compression": "none"}),
        ("allreduce_per_param", AllReduceStrategy, {"bucket_cap_mb": 0}),
        ("allreduce_overlap", AllReduceStrategy, {"overlap": True, "bucket_cap_mb": 5.0}),
        ("allreduce_fp16", AllReduceStrategy, {"compression": "fp16"}),
        ("allreduce_bf16", AllReduceStrategy, {"compression": "bf16"}),
        ("ddp_mp", DDPModelParallelStrategy, {"devices_per_process": 2}),
    ],
)
def test_strategy_names_select_the_app_strategies(name, cls, attributes, tmp_path):
    trainer = fast_trainer(tmp_path, strategy=name, devices=1 if layout_of(name).one_process else 2)
    assert type(trainer.strategy) is cls
    for key, value in attributes.items():
        assert getattr(trainer.strategy, key) == value


STRATEGY_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "strategy"


def test_strategy_fragments_carry_their_knobs(tmp_path):
    def strategy(fragment: str, devices: int = 2):
        args = ["--config", str(STRATEGY_CONFIGS / fragment), "--trainer.devices", str(devices)]
        cli = main([*args, "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path)], run=False)
        return cli.trainer.strategy

    ddp = strategy("ddp.yaml")
    assert type(ddp) is DDPStrategy and ddp._timeout == timedelta(minutes=30)
    assert {k: ddp._ddp_kwargs[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")} == {
        "bucket_cap_mb": 25, "gradient_as_bucket_view": True, "static_graph": False,
    }  # fmt: skip
    allreduce = strategy("allreduce.yaml")
    assert type(allreduce) is AllReduceStrategy and (allreduce.bucket_cap_mb, allreduce.overlap) == (25, False)
    assert strategy("ddp_mp.yaml").devices_per_process == 2
    assert type(strategy("dp.yaml", devices=1)) is DataParallelStrategy


def test_mistakes_name_the_argument():
    """A user's mistake is a UserError with its section (one line from the CLI), still a ValueError for scripts."""
    with pytest.raises(InvalidValue, match="bucket_cap_mb must be >= 0"):
        AllReduceStrategy(bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="compression must be one of"):
        AllReduceStrategy(compression="int8")
    with pytest.raises(InvalidValue, match="devices_per_process must be >= 1"):
        DDPModelParallelStrategy(devices_per_process=0)


def test_the_layout_answers_for_a_configured_and_a_live_strategy_alike():
    """One lookup: the mode's compile choice, batch splits and argument mistakes, by name, config or live strategy."""
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [layout_of(name).runs_compiled_models for name in ("auto", "ddp", "allreduce", "dp", "ddp_mp")] == [
        True, True, True, False, False,
    ]  # fmt: skip
    live_dp = DataParallelStrategy(parallel_devices=gpus)
    assert not layout_of(live_dp).runs_compiled_models and layout_of(live_dp).batch_splits("cuda") == 2
    assert layout_of(DataParallelStrategy(parallel_devices=[torch.device("cpu")] * 2)).batch_splits("cpu") == 1
    assert layout_of(AllReduceStrategy(parallel_devices=gpus)).batch_splits("cuda") == 1
    assert layout_of(DDPModelParallelStrategy(devices_per_process=3)).devices_per_process == 3  # its own argument
    config = {"class_path": "app.strategies.AllReduceStrategy", "init_args": {"bucket_cap_mb": -1}}
    (problem,) = layout_of(config).problems
    assert "bucket_cap_mb must be >= 0" in problem and layout_of("allreduce_fp16").problems == ()


def test_ddp_mp_without_enough_gpus_says_how_to_fix_it():
    strategy = DDPModelParallelStrategy(devices_per_process=2, parallel_devices=[torch.device("cuda", 0)])
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(UserError, match="Fix: trainer.devices = the number of processes per node") as stopped:
        _ = strategy.root_device
    assert stopped.value.help == "ddp-mp-gpus"


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--trainer.strategy", "app.strategies.AllReduceStrategy", "--trainer.strategy.bucket_cap_mb", "-1"], {},
         "allreduce: bucket_cap_mb must be >= 0 (0 = one call per parameter), got -1.0. Fix: "),
        (["--trainer.strategy", "app.strategies.DDPModelParallelStrategy", "--trainer.strategy.devices_per_process",
          "0", "--trainer.devices", "2"], {}, "ddp_mp: devices_per_process must be >= 1, got 0. Fix: "),
        # srun --ntasks 2 of a batch script without SLURM_NTASKS (the preflight sees no SLURM launch): dp's own check
        (["--trainer.strategy", "dp"], {"SLURM_STEP_NUM_TASKS": "2"},
         "dp is single-process, but this run was launched as 2 processes (torchrun WORLD_SIZE or srun --ntasks). "),
    ],
)  # fmt: skip
def test_each_strategy_mistake_is_one_error_line_and_no_traceback(mnist_dir, tmp_path, capsys, monkeypatch, args, env,
                                                                  said):  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *short_fit(tmp_path, mnist_dir, 1, 1), *args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert stopped.value.code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    # the preflight names a wrong argument before the strategy is built (its own check, the one __init__ runs); dp's
    # launch is found as the strategy sets up
    (line,) = [line for line in err.splitlines() if said in line]
    assert line.endswith(("#invalid-value", "#dp-one-process")), line


def test_a_restarted_torchrun_attempt_binds_nccl_as_the_strategy_would():
    """join_this_attempt forms the group before the strategy does: ddp_mp's stages span several GPUs, so no device_id
    (bound to the first stage's GPU, NCCL refused the later stages' tensors); ddp binds its one GPU."""
    from app.launch.rendezvous import device_id_kwargs

    cuda0 = torch.device("cuda", 0)
    assert device_id_kwargs(DDPModelParallelStrategy(devices_per_process=2, parallel_devices=[cuda0])) == {}
    assert device_id_kwargs(DDPStrategy(parallel_devices=[cuda0])) == {"device_id": cuda0}
    assert device_id_kwargs(DDPStrategy(parallel_devices=[torch.device("cpu")])) == {}


def test_buckets_cover_every_parameter_once_in_reverse_order():
    params = [p for p in build("mnist_cnn", num_classes=10, in_channels=1).parameters()]
    per_param = AllReduceStrategy(bucket_cap_mb=0)._make_buckets(params)
    assert [b[0] for b in per_param] == params[::-1] and all(len(b) == 1 for b in per_param)
    cap_mb = 0.05
    buckets = AllReduceStrategy(bucket_cap_mb=cap_mb)._make_buckets(params)
    assert [p for b in buckets for p in b] == params[::-1]
    for bucket in buckets:  # a bucket exceeds the cap only when a single parameter does
        assert len(bucket) == 1 or sum(p.numel() * 4 for p in bucket) <= cap_mb * 2**20
    assert 1 < len(buckets) < len(params)


@pytest.mark.parametrize("arch", ["mnist_cnn", "resnet18"])
def test_model_split_is_contiguous_and_uses_every_stage(arch):
    model = ImageClassifier(arch=arch, num_classes=10, in_channels=1)
    parent, units = split_units(model, 2)
    assert parent is model.net
    stages = balance(units, 2)
    assert stages == sorted(stages) and set(stages) == {0, 1}
    placed = {id(p) for u in units for p in u.parameters()}
    assert placed == {id(p) for p in model.parameters()}  # every parameter lands on a stage
    assert balance(units, 1) == [0] * len(units)


def test_dp_runs_fit_validate_test_predict_on_cpu_and_equals_single_device(mnist_dir, tmp_path, caplog):
    """Without CUDA dp is one device; its code path (step dispatcher, output reduction, logging once) still runs."""

    def train(strategy):
        seed_everything(7)
        model = ImageClassifier(arch="mnist_cnn", optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
        trainer = fast_trainer(tmp_path, strategy=strategy)
        trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir), batch_size=32))
        return model, trainer

    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="dp: no CUDA device selected"):
        model, trainer = train("dp")
    assert "data.batch_size is the global batch" in caplog.text
    reference, reference_trainer = train("auto")
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert {"train/loss", "val/loss", "val/acc1", "val/acc5"} <= set(trainer.callback_metrics)
    datamodule = MNISTDataModule(data_dir=str(mnist_dir), batch_size=32)
    (tested,) = trainer.test(model, datamodule, verbose=False)
    (expected,) = reference_trainer.test(reference, datamodule, verbose=False)
    assert tested == expected  # metrics reduced and logged once: the same numbers as single device
    assert set(tested) == {"test/loss", "test/acc1", "test/acc5"}
    (validated,) = trainer.validate(model, datamodule, verbose=False)
    assert set(validated) == {"val/loss", "val/acc1", "val/acc5"}
    predictions = trainer.predict(model, datamodule)
    assert len(predictions) == 2 and predictions[0]["pred"].shape == (32,)


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "SLURM_STEP_NUM_TASKS"])  # torchrun, srun --ntasks 2
def test_dp_refuses_a_multi_process_launch(mnist_dir, tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "2")
    trainer = fast_trainer(tmp_path, strategy="dp")
    with pytest.raises(UserError, match="Fix: --trainer.strategy ddp"):
        trainer.fit(ImageClassifier(), MNISTDataModule(data_dir=str(mnist_dir), batch_size=32))
