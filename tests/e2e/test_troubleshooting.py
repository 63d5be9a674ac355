"""Each mistake of docs/troubleshooting.md, made as a user makes it: one ``error:`` line that matches the page's quote
and ends with the link to its section, a non-zero exit, nothing started.

Mistakes found before anything is built run in this process (``app.command.main``: its error channel prints the line on
stderr and exits). The four of issue 26 run as real ``python cli.py`` processes, to show the exit status,
the absent traceback and, with two processes, the line on every rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from app.command import main
from tests.conftest import ROOT, run_cli
from tests.troubleshooting import assert_documented
from tools.photos import build_photo_imagenet

CPU = ["--trainer.accelerator", "cpu"]
FAST = [
    *CPU, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
    "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip
IMAGENET = [
    "--config", "configs/imagenet.yaml", "--model.arch", "resnet18", "--data.image_size", "32", "--data.batch_size",
    "4", "--data.num_workers", "0", "--trainer.devices", "1",
]  # fmt: skip
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


@pytest.fixture
def stopped(tmp_path, capsys, monkeypatch):
    """Runs ``cli.py ARGS`` in this process (cwd: the repo); returns (exit status, what the user sees on stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["cli.py"])

    def run(*args: str, data: bool = False) -> tuple[int, str]:
        with pytest.raises(SystemExit) as stop:
            main(list(args))
        code = stop.value.code
        seen = capsys.readouterr().err + (code if isinstance(code, str) else "")
        assert code not in (0, None) and "Traceback" not in seen
        if not data:  # a data mistake is found when the DataModule loads its data, in the run's folder
            assert not list((tmp_path / "run").glob("version_*")), "a run folder was started"
        return (1 if isinstance(code, str) else code), seen

    return run


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return build_photo_imagenet(tmp_path_factory.mktemp("photos"))


def fit(tmp_path: Path, *args: str) -> list[str]:
    # the run folder last: a --config among the args (imagenet.yaml) would otherwise put it under ./runs
    return ["fit", *CPU, *args, "--trainer.default_root_dir", str(tmp_path / "run")]


# (section, exit status, the command's arguments after `fit --trainer.default_root_dir RUN --trainer.accelerator cpu`)
PARSED = [
    ("unknown-option", 2, ["--trainer.max_epoch", "3"]),
    ("invalid-value", 2, ["--trainer.precision", "16-mix"]),
    ("invalid-value", 2, ["--data.batch_size", "x"]),
    ("unknown-strategy", 1, ["--trainer.strategy", "ddpp"]),
    ("unknown-arch", 1, ["--model.arch", "resnet19"]),
    ("unknown-accelerator", 1, ["--trainer.accelerator", "gpuu"]),
    ("batch-size", 1, ["--data.batch_size", "0"]),
    ("global-batch-size", 1, ["--data.global_batch_size", "100", "--trainer.devices", "3"]),
    ("fp16-on-cpu", 1, ["--trainer.precision", "16-mixed"]),
]


@pytest.mark.parametrize(("anchor", "status", "args"), PARSED, ids=[f"{a}:{' '.join(x)}" for a, _, x in PARSED])
def test_a_mistake_on_the_command_line(stopped, tmp_path, anchor, status, args):
    code, seen = stopped(*fit(tmp_path, *args))
    assert code == status
    assert_documented(seen, anchor)
    if status == 1 and anchor not in ("unknown-arch",):  # the preflight's: its header, then one line per problem
        assert_documented(seen, "preflight")


def test_the_global_batch_mistake_is_the_preflight_s_not_the_datamodule_s(stopped, tmp_path):
    """The page quotes what a run prints: the preflight stops it before the DataModule's own check could."""
    _, seen = stopped(*fit(tmp_path, "--data.global_batch_size", "100", "--trainer.devices", "3"))
    line = assert_documented(seen, "global-batch-size")
    assert line.startswith("- data.global_batch_size=100 does not split evenly over world size 3")
    assert "Fix: a multiple of 3 (e.g. 99 or 102)" in line


def test_the_unknown_arch_line_lists_every_name(stopped, tmp_path):
    from modules.zoo import available

    _, seen = stopped(*fit(tmp_path, "--model.arch", "resnet19"))
    line = assert_documented(seen, "unknown-arch")
    assert all(name in line for name in available()) and "tutorial_net" in line


def test_a_mistyped_subcommand_or_config_key(stopped, tmp_path):
    assert_documented(stopped("fitt")[1], "unknown-subcommand")
    config = tmp_path / "typo.yaml"
    config.write_text("trainer:\n  max_epoch: 3\n")
    code, seen = stopped(*fit(tmp_path, "--config", str(config)))
    assert code == 2
    assert_documented(seen, "unknown-config-key")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_a_gpu_asked_for_on_a_machine_without_one(stopped, tmp_path):
    assert_documented(stopped(*fit(tmp_path, "--trainer.accelerator", "gpu"))[1], "no-gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_a_gpu_asked_for_where_the_driver_does_not_fit_this_torch(stopped, tmp_path, monkeypatch):
    version = tmp_path / "version"  # a 550 driver's /proc/driver/nvidia/version: CUDA 12.x, not 13
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    monkeypatch.setenv("DPTRAIN_NVIDIA_VERSION_FILE", str(version))
    line = assert_documented(stopped(*fit(tmp_path, "--trainer.accelerator", "gpu"))[1], "gpu-driver")
    assert "driver 550.54.15" in line and f"CUDA {torch.version.cuda}" in line and "make venv TORCH=cu126" in line


def test_dp_under_torchrun_and_a_folder_that_cannot_be_written(stopped, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    code, seen = stopped("fit", *CPU, "--trainer.default_root_dir", str(tmp_path / "file" / "sub"))
    assert_documented(seen, "root-dir-not-writable")
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert_documented(
        stopped(*fit(tmp_path, "--trainer.strategy", "dp", "--trainer.devices", "2"))[1], "dp-one-process"
    )


def test_data_that_is_missing(stopped, tmp_path, photos):
    _, seen = stopped(*fit(tmp_path, "--data.data_dir", str(tmp_path / "empty"), "--data.download", "false"), data=True)
    assert_documented(seen, "mnist-missing")
    _, seen = stopped(*fit(tmp_path, *IMAGENET, "--data.data_dir", str(tmp_path / "nowhere")), data=True)
    assert_documented(seen, "data-dir-missing")
    for split in ("train", "val"):
        (tmp_path / "flat" / split).mkdir(parents=True)
        (tmp_path / "flat" / split / "rocket.jpg").write_bytes((photos / "val" / "rocket" / "rocket.jpg").read_bytes())
    _, seen = stopped(*fit(tmp_path, *IMAGENET, "--data.data_dir", str(tmp_path / "flat")), data=True)
    assert_documented(seen, "no-class-folder")
    mixed = tmp_path / "mixed"
    (mixed / "val").mkdir(parents=True)
    (mixed / "train").symlink_to(photos / "train")
    for cls in (photos / "val").iterdir():
        (mixed / "val" / ("dog" if cls.name == "cat" else cls.name)).symlink_to(cls)
    _, seen = stopped(*fit(tmp_path, *IMAGENET, "--data.data_dir", str(mixed)), data=True)
    assert_documented(seen, "different-class-folders")


@pytest.fixture(scope="module")
def foreign_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of another network (its hyperparameters say mnist_cnn): written, not trained, for speed."""
    from modules.zoo import build

    path = tmp_path_factory.mktemp("ckpt") / "mnist_cnn.ckpt"
    weights = {f"net.{k}": v for k, v in build("mnist_cnn", num_classes=10, in_channels=1).state_dict().items()}
    torch.save({"state_dict": weights, "hyper_parameters": {"arch": "mnist_cnn"}}, path)
    return path


def test_checkpoints_that_cannot_be_used(stopped, tmp_path, foreign_checkpoint):
    _, seen = stopped(*fit(tmp_path, "--ckpt_path", str(tmp_path / "nope.ckpt")))
    assert_documented(seen, "checkpoint-missing")
    _, seen = stopped("validate", "--trainer.default_root_dir", str(tmp_path / "run"), *CPU, "--ckpt_path", "last")
    assert_documented(seen, "checkpoint-last-missing")
    truncated = tmp_path / "copied.ckpt"
    truncated.write_bytes(foreign_checkpoint.read_bytes()[:5000])
    assert_documented(stopped(*fit(tmp_path, "--ckpt_path", str(truncated)))[1], "checkpoint-corrupt")
    _, seen = stopped(*fit(tmp_path, "--model.arch", "resnet18", "--ckpt_path", str(foreign_checkpoint)))
    assert_documented(seen, "checkpoint-other-arch")
    last = tmp_path / "old" / "version_0" / "checkpoints" / "last.ckpt"  # no hyperparameters: the weights are compared
    last.parent.mkdir(parents=True)
    torch.save({"state_dict": torch.load(foreign_checkpoint, weights_only=True)["state_dict"]}, last)
    _, seen = stopped("validate", "--trainer.default_root_dir", str(tmp_path / "old"), *CPU, "--model.arch",
                      "resnet18", "--ckpt_path", "last")  # fmt: skip
    assert_documented(seen, "checkpoint-does-not-fit")
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["version_0"]  # no new run folder


# --- issue 26, as real processes --------------------------------------------------------------------------------------
class MakesDirectory:
    """A malicious payload: unpickling it calls ``os.makedirs(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker), 0o777, True)


def one_error(done, anchor: str, ranks: int = 1) -> str:
    """The run's one ``error:`` line (per rank): exit 1, no traceback."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == ranks, errors
    return assert_documented(done.stderr, anchor, ranks=ranks)


def test_a_corrupt_checkpoint_is_not_called_dangerous(stopped, tmp_path):
    """Random bytes are no zip archive, so torch reads them as a legacy pickle, which fails the safe loader too: that
    is a corrupt file, not a dangerous one. Only a file that really pickles a global gets the trust hint."""
    noise = tmp_path / "noise.ckpt"
    lines = []
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        noise.write_bytes(torch.randint(0, 256, (100_000,), generator=generator, dtype=torch.uint8).numpy().tobytes())
        lines.append(assert_documented(stopped(*fit(tmp_path, "--ckpt_path", str(noise)))[1], "checkpoint-corrupt"))
    assert not any("--trust_checkpoint" in line or "run code" in line for line in lines), lines


@pytest.mark.slow
def test_a_checkpoint_with_code_names_the_object_and_never_runs_it(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": MakesDirectory(marker)}, evil)
    line = one_error(run_cli(*fit(tmp_path, "--ckpt_path", str(evil)), timeout=300), "checkpoint-with-code")
    assert "(posix.makedirs)" in line or "(os.makedirs)" in line
    assert "--trust_checkpoint true" in line and not marker.exists()


@pytest.mark.slow
def test_an_image_folder_with_one_class(tmp_path, photos):
    root = tmp_path / "one"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        (root / split / "rocket").symlink_to(photos / split / "rocket")
    done = run_cli(*fit(tmp_path, *IMAGENET, "--data.data_dir", str(root)), timeout=300)
    line = one_error(done, "one-class")
    assert f"{root / 'train'} has 1 class folder (rocket)" in line and "ValueError" not in done.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_the_nan_stop_is_one_line_on_every_rank_and_saves_no_weights_only_checkpoint(tmp_path, mnist_dir):
    """lr 1e12: the loss is NaN from the second step. The run's checkpoint is weights-only (Lightning then calls no
    callback's ``on_save_checkpoint``) and, with validation twice an epoch, saved at the end of each validation (after
    step 4 first, when the limit of 3 is reached): the stop comes before that save, on both ranks."""
    config = tmp_path / "weights_only.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {save_weights_only: true, save_last: true}\n"
        "    - class_path: app.callbacks.AMPHealth\n"
    )
    done = run_cli(
        *fit(tmp_path, *FAST, "--config", str(ROOT / "configs" / "mnist_2epochs.yaml"), "--config", str(config)),
        "--data.data_dir", str(mnist_dir), "--model.arch", "mnist_cnn", "--model.optimizer.init_args.lr", "1e12",
        "--trainer.limit_train_batches", "8", "--data.batch_size", "16", "--trainer.val_check_interval", "0.5",
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.logger", "false", timeout=300,
    )  # fmt: skip
    line = one_error(done, "non-finite-loss", ranks=2)
    assert "the last checkpoint is untouched" in line
    assert sorted({ln.split(" at step")[0] for ln in done.stderr.splitlines() if ln.startswith("error: ")}) == [
        "error: the training loss was not finite for 3 consecutive steps (steps 2..4, precision 32-true); loss on "
        f"rank {r}"
        for r in (0, 1)
    ], done.stderr[-2000:]
    assert not list(tmp_path.rglob("*.ckpt")), "a checkpoint of NaN weights was written"
