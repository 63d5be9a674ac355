"""End to end, as a user runs it: `python cli.py fit --test_after_fit best` on real MNIST (what `make demo` runs), then
`python cli.py test --ckpt_path last` in a second process."""

import re

import pytest

from tests.conftest import run_cli


def _acc(output: str) -> float:
    match = re.search(r"test/acc1\W+([0-9.]+)", output)
    assert match, output[-2000:]
    return float(match.group(1))


@pytest.mark.slow
def test_the_default_recipe_reaches_99_percent_then_tests_in_the_same_process(mnist_dir, tmp_path):
    # the default recipe, whole: mnist_lenet, one epoch of 215 steps with OneCycle, MNIST resident in memory
    common = ["--trainer.default_root_dir", str(tmp_path), "--data.data_dir", str(mnist_dir)]
    fit = run_cli("fit", *common, "--test_after_fit", "best", "--trainer.enable_progress_bar", "false")
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "version_0" / "config.yaml").is_file()  # the resolved config is saved with the run
    said = fit.stdout + fit.stderr
    assert "Total FLOPs: 2.5 M" in said  # mnist_lenet: 1.2 M multiply-adds per image, counted by the model summary
    assert "data.resident auto: the splits (210 MB)" in said and "so they stay there" in said
    assert "lr_scheduler: total_steps 215, this run's optimizer steps" in said
    for noise in ("litlogger", "LeafSpec"):  # Lightning's advertisement, torch's deprecation inside Lightning
        assert noise not in said, noise
    assert "test_after_fit: the test set on the best weights" in said
    assert "test: evaluated 10000/10000 images" in said  # the whole official test set, after training
    in_process = _acc(fit.stdout)
    assert in_process >= 0.99
    # the last line: the accuracy and what the whole command cost (make demo ends with it)
    (last,) = re.findall(r"test_after_fit: test/acc1 ([0-9.]+)% on the best weights; ([0-9.]+) s since this process "
                         r"started, imports, fit and test included", said)  # fmt: skip
    assert float(last[0]) == pytest.approx(100 * in_process, abs=0.006) and 1 < float(last[1]) < 600, last

    test = run_cli("test", *common, "--ckpt_path", "last")
    assert test.returncode == 0, test.stderr[-3000:]
    said = test.stdout + test.stderr
    assert "test: evaluated 10000/10000 images" in said
    assert "dirpath has changed" not in said and "callbacks used to create the checkpoint" not in said
    assert _acc(test.stdout) == in_process  # one epoch: last.ckpt holds the best weights
