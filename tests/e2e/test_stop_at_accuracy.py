"""As a user runs it: `python cli.py fit --stop_at_accuracy.target 85` on real MNIST stops once val/acc1 >= 85 %,
and the time to accuracy is in the log, in TensorBoard and in the final summary."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import run_cli

MAX_EPOCHS = 8


@pytest.mark.slow
def test_stops_at_target_and_records_time_to_accuracy(mnist_dir, tmp_path):
    fit = run_cli(
        "fit", "--config", "configs/mnist_2epochs.yaml",  # reaches 85% in its 3rd or a later epoch of 12 batches
        "--trainer.default_root_dir", str(tmp_path), "--data.data_dir", str(mnist_dir),
        "--stop_at_accuracy.target", "85", "--trainer.max_epochs", str(MAX_EPOCHS),
        "--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "5", "--data.batch_size", "64",
        "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "4",
    )  # fmt: skip
    output = fit.stdout + fit.stderr
    assert fit.returncode == 0, output[-3000:]
    assert "Time to accuracy: val/acc1 >= 0.8500 after" in output
    assert "Training summary" in output and "time to target" in output

    summary = json.loads((tmp_path / "version_0" / "summary.json").read_text())
    reached = summary["time to target"]
    assert reached["reached"] >= 0.85 and summary["best val/acc1"] >= 0.85
    assert reached["epochs"] < MAX_EPOCHS and summary["epochs"] < MAX_EPOCHS  # it stopped early
    assert reached["samples"] == reached["epochs"] * 12 * 64 and reached["wall_s"] > 0
    assert summary["mean images/s (global)"] > 0 and summary["precision"] == "32-true"

    events = EventAccumulator(str(tmp_path / "version_0")).Reload()
    accuracies = [point.value for point in events.Scalars("val/acc1")]
    # it trained on while below the target (several validations: 5 with this seed) and stopped at the first one that
    # reached it, whose value is the one reported
    assert len(accuracies) == reached["epochs"] == summary["epochs"] >= 3, accuracies
    assert max(accuracies[:-1]) < 0.85 <= accuracies[-1], accuracies
    assert reached["reached"] == pytest.approx(accuracies[-1], abs=1e-6)
    assert summary["best val/acc1"] == reached["reached"]
    for key in ("wall_s", "epochs", "samples"):
        (point,) = events.Scalars(f"time_to_target/{key}")
        assert point.value == pytest.approx(reached[key], rel=1e-6)
    for key in ("perf/images_per_sec", "perf/images_per_sec_per_device", "perf/data_time_frac"):
        assert events.Scalars(key), key
