"""End to end, as a user runs it: `python cli.py fit` on real MNIST, then `python cli.py test --ckpt_path last`."""

import re

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
def test_fit_then_test_reaches_98_percent(mnist_dir, tmp_path):
    # the default config (mnist_fast, SGD, linear warm-up and decay per step) shortened to 200 batches of 128:
    # its per-step schedule is told the shorter length, as a user shortening the run would
    common = ["--trainer.default_root_dir", str(tmp_path), "--data.data_dir", str(mnist_dir)]
    fit = run_cli(
        "fit", *common, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "200",
        "--model.lr_scheduler.total_iters", "200", "--trainer.limit_val_batches", "10",
        "--trainer.enable_progress_bar", "false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "version_0" / "config.yaml").is_file()  # the resolved config is saved with the run
    said = fit.stdout + fit.stderr
    assert "Total FLOPs: 3.8 M" in said  # mnist_fast: 1.9 M multiply-adds per image, counted by the model summary
    for noise in ("litlogger", "LeafSpec"):  # Lightning's advertisement, torch's deprecation inside Lightning
        assert noise not in said, noise

    test = run_cli("test", *common, "--ckpt_path", "last")
    assert test.returncode == 0, test.stderr[-3000:]
    said = test.stdout + test.stderr
    assert "test: evaluated 10000/10000 images" in said  # the whole official test set
    assert "dirpath has changed" not in said and "callbacks used to create the checkpoint" not in said
    match = re.search(r"test/acc1\W+([0-9.]+)", test.stdout)
    assert match, test.stdout[-2000:]
    assert float(match.group(1)) >= 0.98
