"""AMP health, throughput, stop-at-accuracy and the summary, each with a real Trainer on real MNIST on CPU.

Overflow and NaN are provoked on purpose: an inf written into a real gradient, NaN written into a real batch.
The real GradScaler path runs on CPU through Lightning's MixedPrecision plugin with ``device="cpu"`` (torch's CPU
autocast supports fp16 and ``GradScaler("cpu")`` works; Lightning only swaps the *string* "16-mixed" for bf16 on CPU).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, Dataset

from app.callbacks import AMPHealth, NonFiniteLossError, StopAtAccuracy, Throughput, TrainingSummary
from app.callbacks.stop_at_accuracy import as_fraction
from datamodules import MNISTDataModule
from datamodules.resumable import ResumableLoader, ResumableSampler
from modules import ImageClassifier


def trainer_for(tmp_path, callbacks, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    return Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def mnist(mnist_dir, batch_size: int = 4) -> MNISTDataModule:
    return MNISTDataModule(data_dir=str(mnist_dir), batch_size=batch_size)


def per_step_model(lr: float = 0.1) -> ImageClassifier:
    return ImageClassifier(
        optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lr_scheduler_interval="step",
    )


class InfInGradient(Callback):
    """Writes +inf into one real gradient (after the scaled backward) at the given batch indices."""

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches
        self.weights_before: dict[int, torch.Tensor] = {}
        self.weights_after: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights_before[batch_idx] = pl_module.net[-1].weight.detach().clone()

    def on_after_backward(self, trainer, pl_module):
        if trainer.fit_loop.epoch_loop.batch_idx in self.batches:
            pl_module.net[-1].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights_after[batch_idx] = pl_module.net[-1].weight.detach().clone()


class NaNInput(Callback):
    """Replaces the images with NaN from batch ``start`` on: the loss (and every gradient) becomes NaN."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.start:
            batch[0].fill_(float("nan"))


@pytest.fixture
def lightning_info(caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    return caplog


def test_overflow_skips_the_step_holds_the_scheduler_and_reports(mnist_dir, tmp_path, lightning_info):
    seed_everything(0)
    model, inject = per_step_model(), InfInGradient({2, 3})
    amp = AMPHealth(message_interval_steps=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # low enough that only the injected infs overflow
    trainer = trainer_for(tmp_path, [inject, amp], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(model, mnist(mnist_dir))

    assert amp.skipped_steps == 2
    assert trainer.callback_metrics["amp/skipped_steps"] == 2
    assert trainer.callback_metrics["amp/loss_scale"] == 2.0**8  # halved once per overflow
    # the overflowing steps left the weights alone; the others changed them
    for i in range(6):
        same = torch.equal(inject.weights_before[i], inject.weights_after[i])
        assert same == (i in (2, 3)), i
    # 6 optimizer steps, 2 skipped: a per-step StepLR advanced 4 times, not 6 (Lightning#5558)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    # one rate-limited line: the second overflow, one step later, is folded into the next message
    lines = [r.getMessage() for r in lightning_info.records if "Gradient overflow" in r.getMessage()]
    assert lines == ["Gradient overflow at step 3. Skipping step, loss scaler reducing loss scale to 512"]
    assert amp.overflow_messages == lines


def test_every_overflow_reported_when_the_interval_allows(mnist_dir, tmp_path):
    amp = AMPHealth(message_interval_steps=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = trainer_for(
        tmp_path, [InfInGradient({1, 2, 4}), amp], plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    model = per_step_model()
    model.hparams.warmup_epochs = 1  # the classifier's warmup scales the lr inside optimizer_step only
    trainer.fit(model, mnist(mnist_dir))
    assert [m.split(" to ")[-1] for m in amp.overflow_messages] == ["512", "256", "128"]
    # 3 of 6 steps skipped: the schedule advanced 3 times, and no warmup-scaled lr was left behind by the rollback
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_consecutive_nonfinite_losses_stop_with_a_diagnosis(mnist_dir, tmp_path, precision):
    plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else []
    amp = AMPHealth(max_nonfinite_steps=3)
    trainer = trainer_for(tmp_path, [NaNInput(start=2), amp], plugins=plugins, limit_train_batches=10)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(per_step_model(), mnist(mnist_dir))
    message = str(err.value)
    assert "not finite for 3 consecutive steps (steps 3..5" in message
    assert "loss on rank 0 at step 5: nan" in message
    assert "Parameters with non-finite gradients: net.0.weight, net.0.bias" in message
    assert "lower the learning rate" in message
    assert trainer.global_step == 5  # stopped right away, not after 10 steps


def test_isolated_nonfinite_loss_is_tolerated(mnist_dir, tmp_path):
    class OneNaN(NaNInput):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == self.start:
                batch[0].fill_(float("nan"))

    seed_everything(0)
    amp = AMPHealth(max_nonfinite_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # low enough that only the NaN batch overflows
    trainer = trainer_for(tmp_path, [OneNaN(start=1), amp], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(per_step_model(), mnist(mnist_dir))  # the scaler skips the NaN step; training goes on
    assert trainer.global_step == 6 and amp.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_nonfinite_losses_that_are_not_consecutive_are_tolerated(mnist_dir, tmp_path):
    """Four NaN losses in eight steps, never two in a row: a limit of 2 *consecutive* ones is never reached (a counter
    of all the non-finite losses would stop the run at the second)."""

    class EveryOtherNaN(NaNInput):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % 2 == 1:
                batch[0].fill_(float("nan"))

    seed_everything(0)
    amp = AMPHealth(max_nonfinite_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # the scaler skips each NaN step: the weights stay finite
    trainer = trainer_for(
        tmp_path, [EveryOtherNaN(start=1), amp], plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        limit_train_batches=8, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(per_step_model(), mnist(mnist_dir))
    assert trainer.global_step == 8 and amp.skipped_steps == 4


def test_amp_health_is_silent_without_a_scaler(mnist_dir, tmp_path):
    amp = AMPHealth()
    trainer = trainer_for(tmp_path, [amp], precision="bf16-mixed")
    trainer.fit(per_step_model(), mnist(mnist_dir))
    assert "amp/loss_scale" not in trainer.callback_metrics and amp.skipped_steps == 0


class SlowImages(Dataset):
    """Random MNIST-shaped images, one in ``every`` taking ``delay`` seconds to load, like a starving input pipeline."""

    def __init__(self, n: int, delay: float, every: int = 4) -> None:
        self.n, self.delay, self.every = n, delay, every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i % self.every == 0:
            time.sleep(self.delay)
        return torch.randn(1, 28, 28), i % 10


def test_throughput_metrics_and_a_starving_loader(mnist_dir, tmp_path):
    fast, slow = Throughput(window=4), Throughput(window=2)
    trainer = trainer_for(tmp_path, [fast], limit_train_batches=6)
    trainer.fit(ImageClassifier(), mnist(mnist_dir))
    metrics = trainer.callback_metrics
    assert metrics["perf/images_per_sec"] > 0
    assert metrics["perf/images_per_sec_per_device"] == metrics["perf/images_per_sec"]  # one device
    assert fast.total_images == 6 * 4 and fast.mean_images_per_sec > 0

    starving = trainer_for(tmp_path, [slow], limit_train_batches=3)
    starving.fit(ImageClassifier(), DataLoader(SlowImages(12, delay=1.5), batch_size=4))
    # 1.5 s of loading per batch against milliseconds of compute: data time dominates and the metric says so
    assert starving.callback_metrics["perf/data_time_frac"] > 0.5
    assert metrics["perf/data_time_frac"] < starving.callback_metrics["perf/data_time_frac"]


class SlowStepEnd(Callback):
    """Lightning's loop between two steps made slow: ``delay`` seconds in a step-end hook that runs after the
    timing callbacks' (time outside the step that is not waiting for data)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.delay)


def test_data_wait_is_the_wait_for_the_batch_and_lightnings_loop_is_apart(tmp_path):
    """The app's training loader tells when the loop asked for a batch: a slow loader shows as data wait, a slow
    loop between steps as loop time, not as data wait (both were one gap before)."""

    def loader(delay: float) -> ResumableLoader:
        images = SlowImages(16, delay, every=1)  # delay x 4 per batch
        return ResumableLoader(images, ResumableSampler(images), batch_size=4)

    slow_data, slow_loop = Throughput(window=2), Throughput(window=2)
    trainer_for(tmp_path, [slow_data], limit_train_batches=4).fit(ImageClassifier(), loader(0.1))
    trainer_for(tmp_path, [slow_loop, SlowStepEnd(0.3)], limit_train_batches=4).fit(ImageClassifier(), loader(0.0))
    # each is a large share of the step, and the other share is small beside it (CPU steps take tens of ms here)
    data, loop = slow_data.data_wait_frac, slow_data.loop_frac
    assert data > 0.3 and data > 10 * loop, (data, loop)
    data, loop = slow_loop.data_wait_frac, slow_loop.loop_frac
    assert loop > 0.3 and loop > 10 * data, (data, loop)


@pytest.mark.parametrize(("given", "fraction"), [(0.75, 0.75), (75, 0.75), (1, 1.0), (99.5, 0.995), (None, None)])
def test_target_as_fraction_or_percent(given, fraction):
    assert as_fraction(given) == fraction


@pytest.mark.parametrize("bad", [0, -5, 100.5, 250])
def test_target_out_of_range_is_explained(bad):
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\] such as 0.75 or a percent in \(1, 100\]"):
        StopAtAccuracy(target=bad)


def test_stop_at_accuracy_and_summary(mnist_dir, tmp_path, lightning_info):
    seed_everything(0)
    stop, summary, throughput = StopAtAccuracy(target=70), TrainingSummary(), Throughput()
    trainer = trainer_for(
        tmp_path, [stop, summary, throughput, AMPHealth()], max_epochs=10, limit_train_batches=10,
        limit_val_batches=4,
    )  # fmt: skip
    trainer.fit(ImageClassifier(), mnist(mnist_dir, batch_size=32))
    assert trainer.current_epoch < 10  # stopped early
    result = stop.result
    assert result is not None and result["reached"] >= 0.7 and result["target"] == 0.7
    assert result["samples"] == 10 * 32 * result["epochs"] and result["wall_s"] > 0
    assert summary.summary["best val/acc1"] >= 0.7 and summary.summary["time to target"] == result
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["precision"] == "32-true" and written["world size"] == 1 and written["strategy"]
    text = "\n".join(r.getMessage() for r in lightning_info.records)
    assert "Training summary" in text and "time to target" in text and "mean images/s (global)" in text
    assert "Time to accuracy: val/acc1 >= 0.7000" in text


def test_stop_at_accuracy_without_target_does_nothing(mnist_dir, tmp_path):
    stop = StopAtAccuracy()
    trainer = trainer_for(tmp_path, [stop], max_epochs=2, limit_train_batches=2)
    trainer.fit(ImageClassifier(), mnist(mnist_dir))  # no val/acc1 at all, and no complaint
    assert trainer.current_epoch == 2 and stop.result is None


def test_nonfinite_run_between_logging_steps_stops_before_the_next_checkpoint(mnist_dir, tmp_path):
    """With no logging step in the run, the device-side count is read when a checkpoint is built: the run stops
    there, every rank together, and the NaN weights are not written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    amp = AMPHealth(max_nonfinite_steps=3)
    trainer = trainer_for(
        tmp_path, [NaNInput(start=2), amp, saves], enable_checkpointing=True, log_every_n_steps=50,
        limit_train_batches=10,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(per_step_model(), mnist(mnist_dir))
    assert "not finite for 4 consecutive steps (steps 3..6" in str(err.value)
    assert trainer.global_step == 6 and not list((tmp_path / "ckpt").glob("*.ckpt"))


class NaNFrom(Callback):
    """From batch ``start`` on the loss is NaN: its NaN gradient makes the fp32 weights NaN, so every later loss is."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            batch[0].fill_(float("nan"))


@pytest.mark.parametrize(
    ("nan_from", "every", "said"),
    [
        # saves at steps 2 and 4; the loss of step 4 (batch 3) is the first NaN: the save at step 4 holds NaN weights
        (3, 2, "a checkpoint may have been saved at step 4, just after a non-finite loss"),
        # a save at step 4 before the NaN losses (steps 5..7), none after: the last checkpoint is untouched
        (4, 4, "Training was stopped before saving NaN weights; the last checkpoint is untouched"),
    ],
)
def test_the_stop_says_whether_a_weights_only_save_followed_a_nonfinite_loss(
    mnist_dir, tmp_path, nan_from, every, said
):
    """A weights-only ModelCheckpoint (Lightning calls no on_save_checkpoint for it) saving below the limit: the stop's
    message names the save that came just after a non-finite loss, and only such a save."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1, save_weights_only=True)
    trainer = trainer_for(
        tmp_path, [NaNFrom(nan_from), AMPHealth(max_nonfinite_steps=3), saves], enable_checkpointing=True,
        limit_train_batches=10,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(per_step_model(), mnist(mnist_dir))
    assert said in str(err.value)
    assert trainer.global_step == nan_from + 3  # stopped at the third NaN loss


def test_overflows_are_counted_per_optimizer_step_with_gradient_accumulation(mnist_dir, tmp_path):
    """Two micro-batches per step: the loss scale is compared around optimizer steps only (a micro-batch that only
    accumulates has no "before"), and the inf in the second step's second micro-batch skips that one step."""
    amp = AMPHealth()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = trainer_for(
        tmp_path, [InfInGradient({3}), amp], plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(per_step_model(), mnist(mnist_dir))
    assert trainer.global_step == 3 and amp.skipped_steps == 1
    message = "Gradient overflow at step 2. Skipping step, loss scaler reducing loss scale to 512"
    assert amp.overflow_messages == [message]  # the second step (batches 2 and 3)
