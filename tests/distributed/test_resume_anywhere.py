"""A run stopped mid-epoch by a real SIGTERM and resumed with ``--ckpt_path last`` ends exactly as an uninterrupted
run: the same weights bit for bit, and every rank trained the same samples, in the same order, with the same
augmentations (a digest of each sample's pixels after its crop and flip, recorded by ``tools.resume_probe.SampleLog``).

Each scenario has three legs through the app's real CLI (``app.command.main``): the uninterrupted run; the same run that
sends itself SIGTERM so that it stops after a mid-epoch global step; and its resume. Single device runs in this
process; ``ddp``, every ``allreduce`` variant and ``ddp_mp`` run in one 2-process gloo job (torchrun), all their legs in
one process group. The modern ImageNet recipe (``configs/imagenet_modern.yaml``: TrivialAugment, random erasing,
mixup/cutmix, repeated augmentation, the weights' moving average) on real photos: one device with 0 workers (CPU
decoding) and 2 (GPU decoding's path), ``ddp`` with 2 workers and ``allreduce`` with none; the average and the training
weights both end bit for bit.
Also here: a mid-epoch checkpoint resumed with another per-device batch is refused in one line, and a checkpoint
without loader state (an earlier version's) resumes with one warning.

Run as a module (``torchrun ... -m tests.distributed.test_resume_anywhere OUT DATA``) it is the distributed job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tools.photos import build_photo_imagenet
from tools.resume_legs import EPOCH_VALUES, STOP, fit, imagenet_args, legs, max_diff, mnist_args, scenarios, trail


def check(facts: dict, stop: int = STOP, steps: int = 12, batches: int = 12) -> None:
    assert facts["exit"] == 143 and facts["saved_step"] == stop and facts["saved_epoch"] == 1, facts
    assert facts["steps"] == [steps, steps], facts
    assert facts["loader_state"] and facts["loader_state"][0]["epoch"] == 1, facts
    for rank, seen in facts["samples"].items():
        assert seen["trained"] == seen["recorded"] == batches, (rank, facts)  # stopped + resumed: each batch once
        assert seen["same"] and seen["epoch1_repeats"] == 0, (rank, facts)
    # allreduce averages the ranks' BatchNorm statistics at each checkpoint (each rank keeps its own between them), so
    # after a stop the resumed ranks start from the average: its running statistics end equal to rounding, not to the
    # bit; the weights (parameters) and the average's do not depend on them
    buffers = facts.get("buffers_to_rounding", 0.0)
    assert facts["max_diff_weights"] == 0.0, f"resumed run's weights differ from the uninterrupted one's: {facts}"
    assert facts["max_diff"] <= buffers, f"resumed run differs from the uninterrupted one: {facts}"
    if facts["max_diff_training"] is not None:  # a moving average: the weights above are it, these the training ones
        assert facts["max_diff_training_weights"] == 0.0 and facts["max_diff_training"] <= buffers, facts
        assert facts["average_vs_training"] > 0, facts  # not vacuous: the average is not the training weights
    # the interrupted epoch's train/*_epoch: over all its batches, not only those after the resume (the sums over the
    # ranks are added in another order after a 2-process resume, and logged as float32: equal to its rounding)
    full, resumed = facts["epoch_values"]
    assert set(full) == set(EPOCH_VALUES) and resumed == pytest.approx(full, rel=1e-6, abs=0), facts["epoch_values"]


@pytest.mark.slow
def test_single_device_mid_epoch_resume_is_exact(mnist_dir, tmp_path, recwarn, capsys):
    """num_workers 0 and 2 (persistent workers), MNIST with dropout; then the refusal and the old-checkpoint line."""
    for workers in (0, 2):
        facts = legs(tmp_path / f"w{workers}", mnist_args(tmp_path, str(mnist_dir), workers), [], ranks=1)
        check(facts)
    # accumulate_grad_batches 2: SIGTERM arrives after step 3 (the end of epoch 0); the next batch is the first of an
    # accumulation, so the stop waits for the batch after it (step 4, epoch 1 batch 1): nothing is rolled back
    data = mnist_args(tmp_path, str(mnist_dir), 0)
    accumulated = legs(tmp_path / "acc2", data, ["--trainer.accumulate_grad_batches", "2"], ranks=1, stop=4)
    check(accumulated, stop=4, steps=6, batches=12)
    assert accumulated["loader_state"][0]["batches"] == 2, accumulated
    # another per-device batch, mid-epoch: one line naming the fix, nothing trained
    at = data.index("--data.batch_size") + 1
    batch16 = [*data[:at], "16", *data[at + 1 :]]
    with pytest.raises(SystemExit) as refused:
        fit(tmp_path / "batch16", batch16, ["--ckpt_path", facts["stopped_ckpt"]])
    err = capsys.readouterr().err
    assert refused.value.code == 1, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "saved mid-epoch (epoch 1, batch 3)" in line and "batch_size 8 -> 16" in line and "data.batch_size" in line
    # a checkpoint of an earlier version (no loader state) resumes as before, with one warning
    old = torch.load(facts["stopped_ckpt"], weights_only=True)
    del old["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(old, tmp_path / "old.ckpt")
    fit(tmp_path / "old", data, ["--ckpt_path", str(tmp_path / "old.ckpt")])
    lines = [str(w.message) for w in recwarn if "without the loader's position" in str(w.message)]
    assert len(lines) == 1 and "batch 3 of epoch 1" in lines[0], lines


@pytest.mark.slow
def test_mid_epoch_checkpoints_of_every_n_train_steps_and_max_steps_and_dp_resume_exactly(mnist_dir, tmp_path):
    """Stops that write their checkpoint without a signal: ``ModelCheckpoint(every_n_train_steps)`` mid-epoch and
    ``--trainer.max_steps`` reached mid-epoch then raised; and the ``dp`` strategy's CPU path, stopped by SIGTERM."""
    data = mnist_args(tmp_path, str(mnist_dir), 0)
    # the uninterrupted run saves every STOP steps: step9.ckpt at epoch 1, batch 3 (its last.ckpt, the same save, is
    # overwritten at the end of this run)
    every = [
        "--checkpoint.every_n_train_steps", str(STOP), "--checkpoint.monitor", "null", "--checkpoint.save_top_k", "-1",
        "--checkpoint.filename", "step{step}",
    ]  # fmt: skip
    full = fit(tmp_path / "every", data, every)
    mid = tmp_path / "every" / "version_0" / "checkpoints" / f"step{STOP}.ckpt"
    assert torch.load(mid, weights_only=True)["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    resumed = fit(tmp_path / "from_every", data, ["--ckpt_path", str(mid)])
    assert resumed.trainer.global_step == 12 and max_diff(full.model.state_dict(), resumed.model.state_dict()) == 0.0
    assert trail(tmp_path / "from_every") == trail(tmp_path / "every")[STOP:]  # the rest of epoch 1, once each
    # max_steps reached mid-epoch (its last.ckpt written at the end of fit), then raised
    stopped = fit(tmp_path / "max_steps", data, ["--trainer.max_steps", str(STOP)])
    last = tmp_path / "max_steps" / "version_0" / "checkpoints" / "last.ckpt"
    assert stopped.trainer.global_step == STOP and torch.load(last, weights_only=True)["global_step"] == STOP
    raised = fit(tmp_path / "max_steps", data, ["--trainer.max_steps", "-1", "--ckpt_path", "last"])
    assert raised.trainer.global_step == 12 and max_diff(full.model.state_dict(), raised.model.state_dict()) == 0.0
    assert trail(tmp_path / "max_steps") == trail(tmp_path / "every")
    # dp on CPU (one process, no replicas): stopped by SIGTERM mid-epoch
    check(legs(tmp_path / "dp", data, ["--trainer.strategy", "dp"], ranks=1))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return build_photo_imagenet(tmp_path_factory.mktemp("imagenet"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_modern_imagenet_recipe_mid_epoch_resume_is_exact(photos, tmp_path, workers):
    """Real photos through the modern recipe: with 2 workers each batch is decoded by nvImageCodec in the training
    process (``--data.decode gpu``; its CPU backend here), the workers drawing the crops, flips, TrivialAugment
    operations and erasing boxes it applies; with none the CPU path draws and applies them. The mixing of each batch,
    the repeated-augmentation sampler and the moving average resume where they were. (The classic recipe's CPU path
    resumes through the same seeded draws: tests/distributed/test_shards_resume.py.)"""
    data = imagenet_args(tmp_path, str(photos), workers, "imagenet_modern.yaml")
    facts = legs(tmp_path, [*data, "--data.decode", "gpu" if workers else "cpu"], [], ranks=1)
    check(facts)
    assert facts["loader_state"][0]["repeats"] == 4, facts["loader_state"]


@pytest.fixture(scope="module")
def distributed_facts(mnist_dir, photos, tmp_path_factory) -> dict:
    from tools.torchrun import run_torchrun_job

    out = tmp_path_factory.mktemp("resume_anywhere")
    return run_torchrun_job(
        "tests.distributed.test_resume_anywhere", [str(out), str(mnist_dir), str(photos)], 2, out / "results.json",
        "resume", timeout=900,
    )  # fmt: skip


def modern_scenarios() -> dict[str, tuple[list[str], int]]:
    """The modern recipe in the 2-process job: ``ddp`` with 2 loader workers, ``allreduce`` with none."""
    return {
        "modern_ddp_w2": (["--trainer.strategy", "ddp"], 2),
        "modern_allreduce_w0": (["--trainer.strategy", "allreduce"], 0),
    }


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("scenario", [*scenarios(), *modern_scenarios()])
def test_distributed_mid_epoch_resume_is_exact(distributed_facts, scenario):
    check(distributed_facts[scenario], **distributed_facts[scenario].get("expect", {}))


def job(out: Path, data_dir: str, photos: str) -> None:
    """One rank of the torchrun job: the three legs of every scenario; rank 0 writes the facts."""
    import torch.distributed as dist

    from app.strategies.modes import REFERENCE

    results = {}
    for name, (extra, workers) in scenarios().items():
        args = [*extra, "--trainer.devices", "2", "--launch.timeout", "120"]
        results[name] = legs(out / name, mnist_args(out, data_dir, workers), args, ranks=2)
    for name, (extra, workers) in modern_scenarios().items():
        args = [*extra, "--trainer.devices", "2", "--launch.timeout", "120"]
        data = imagenet_args(out, photos, workers, "imagenet_modern.yaml")
        # 18 photos, 3 per rank: 3 batches an epoch; the stop at step 5 is the second batch of epoch 1
        results[name] = legs(out / name, data, args, ranks=2, stop=5, batches=3)
        results[name]["expect"] = {"stop": 5, "steps": 6, "batches": 6}
        if "allreduce" in name:  # its BatchNorm statistics: see check()
            results[name]["buffers_to_rounding"] = 1e-6
    if dist.get_rank() == 0:
        # ddp_w0 read MNIST resident, ddp_w2 through the DataLoader's workers: each rank's samples, in order
        resident, loader = (out / f"{REFERENCE}_w{w}" / "full" for w in (0, 2))
        results["paths_same"] = {rank: trail(resident, rank) == trail(loader, rank) for rank in (0, 1)}
        results["paths_batches"] = [len(trail(resident, rank)) for rank in (0, 1)]
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


@pytest.mark.slow
@pytest.mark.distributed
def test_resident_and_loader_paths_give_each_rank_the_same_samples(distributed_facts):
    """MNIST held resident (one indexing per batch) and read through 2 loader workers: with the same seed, each rank
    trains the same samples in the same order (12 batches each: 2 epochs of 6)."""
    assert distributed_facts["paths_batches"] == [12, 12], distributed_facts["paths_batches"]
    assert distributed_facts["paths_same"] == {"0": True, "1": True}, distributed_facts["paths_same"]


@pytest.mark.slow
@pytest.mark.distributed
def test_mid_epoch_checkpoint_on_fewer_processes_is_refused(distributed_facts, mnist_dir, tmp_path, capsys):
    """The 2-process ddp checkpoint, stopped mid-epoch, resumed on one device: one line naming the fix."""
    with pytest.raises(SystemExit) as refused:
        fit(
            tmp_path,
            mnist_args(tmp_path, str(mnist_dir), 0),
            ["--ckpt_path", distributed_facts["ddp_w0"]["stopped_ckpt"]],
        )
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert refused.value.code == 1 and "num_replicas 2 -> 1" in line and "trainer.devices/num_nodes" in line, line


if __name__ == "__main__":
    import gc

    gc.freeze()  # as cli.py does: the imports' objects out of the cyclic collector's reach
    job(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
