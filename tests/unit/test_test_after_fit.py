"""`fit --test_after_fit best|last` tests in the same process once training ends; the default recipe's OneCycle runs
over the run's own length, and a OneCycle shorter than the run is refused before training."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.fabric.utilities.data
import pytest

from app.command import main
from tests.conftest import short_fit


def test_last_checkpoint_is_tested_after_fit(mnist_dir, tmp_path):
    cli = main(["fit", *short_fit(tmp_path, mnist_dir, 5, 2), "--test_after_fit", "last",
                "--trainer.limit_test_batches", "2"])  # fmt: skip
    assert Path(cli.trainer.ckpt_path).name == "last.ckpt"  # the checkpoint trainer.test loaded
    assert {"test/acc1", "test/loss"} <= set(cli.trainer.callback_metrics)
    assert cli.model.evaluated["test"] == (512, 10000)  # 2 batches of 256 of the official test set
    assert cli.trainer.global_step == 5  # training was not touched by the test


def test_without_checkpoints_the_final_weights_are_tested(mnist_dir, tmp_path):
    cli = main(["fit", *short_fit(tmp_path, mnist_dir, 3, 1), "--test_after_fit", "best",
                "--trainer.enable_checkpointing", "false", "--trainer.limit_test_batches", "1"])  # fmt: skip
    assert cli.trainer.ckpt_path is None and "test/acc1" in cli.trainer.callback_metrics


def test_onecycle_runs_over_the_run_and_a_shorter_one_is_refused(mnist_dir, tmp_path, capsys):
    cli = main(["fit", *short_fit(tmp_path / "a", mnist_dir, 4, 1), "--trainer.max_epochs", "2"])
    (config,) = cli.trainer.lr_scheduler_configs
    assert type(config.scheduler).__name__ == "OneCycleLR" and config.scheduler.total_steps == 8
    assert cli.trainer.global_step == 8 and config.scheduler.last_epoch == 8  # stepped once per step, to its end
    with pytest.raises(SystemExit) as refused:
        main(["fit", *short_fit(tmp_path / "b", mnist_dir, 4, 1), "--trainer.max_epochs", "2",
              "--model.lr_scheduler.init_args.total_steps", "5"])  # fmt: skip
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert refused.value.code == 1 and "total_steps=5 optimizer steps but this run makes 8: it would stop" in line
    assert "--model.lr_scheduler.init_args.total_steps 8" in line


def test_a_longer_run_resumed_from_a_onecycle_checkpoint_is_refused_checkpoint_kept(mnist_dir, tmp_path, capsys):
    main(["fit", *short_fit(tmp_path, mnist_dir, 3, 1)])
    last = next(tmp_path.rglob("last.ckpt"))
    before = last.read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(["fit", *short_fit(tmp_path, mnist_dir, 3, 1), "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert refused.value.code == 1 and "OneCycleLR of the checkpoint runs over total_steps=3" in line
    assert "this run makes 6" in line and "--model.weights CHECKPOINT" in line
    assert last.read_bytes() == before  # the good checkpoint is untouched


def test_onecycle_names_what_it_cannot_schedule_and_an_unused_optimizer_lr(mnist_dir, tmp_path, capsys, recwarn):
    with pytest.raises(SystemExit) as refused:  # pct_start x steps = 1: torch's OneCycleLR divides by zero
        main(["fit", *short_fit(tmp_path / "a", mnist_dir, 4, 1), "--model.lr_scheduler.init_args.pct_start", "0.25"])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert refused.value.code == 1
    assert "OneCycleLR cannot schedule a run of 4 optimizer steps with pct_start 0.25" in line
    main(["fit", *short_fit(tmp_path / "b", mnist_dir, 2, 1), "--model.optimizer.init_args.lr", "0.05"])
    said = [str(w.message) for w in recwarn if "OneCycleLR sets the learning rate" in str(w.message)]
    assert said == [
        "lr_scheduler OneCycleLR sets the learning rate from its max_lr 0.01: the optimizer's lr 0.05 is not used. "
        "To change the peak learning rate: --model.lr_scheduler.init_args.max_lr 0.05"
    ]


def test_the_demo_says_nothing_a_user_cannot_act_on(mnist_dir, tmp_path, monkeypatch):
    """``make demo`` (``cli.py fit --test_after_fit best``, the default relative run folder): no hint that more loader
    workers would help while the data is resident, and the best checkpoint reloads without "The dirpath has changed".

    Lightning gives the worker hint only on a machine with more than 2 CPUs, so it is told the 16 of the GPU node
    the demo ran on; the same fit on the per-sample path first shows that this test sees the hint when it is given.
    """
    monkeypatch.chdir(tmp_path)  # runs/mnist, relative, as in a checkout
    monkeypatch.setattr(lightning.fabric.utilities.data, "_num_cpus_available", lambda: 16)
    short = ["--data.data_dir", str(mnist_dir), "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches",
             "2", "--trainer.limit_test_batches", "2", "--trainer.accelerator", "cpu"]  # fmt: skip

    def said(*args: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:  # also takes back the filter a resident run installs
            warnings.simplefilter("always")
            main(["fit", *short, *args])
        return [str(w.message) for w in caught]

    per_sample = said("--data.resident", "false", "--data.num_workers", "0", "--trainer.default_root_dir", "other")
    assert [m for m in per_sample if "does not have many workers" in m]
    demo = said("--test_after_fit", "best")
    assert not [m for m in demo if "does not have many workers" in m or "dirpath has changed" in m], demo
    assert (tmp_path / "runs" / "mnist" / "version_0" / "checkpoints" / "last.ckpt").is_file()
