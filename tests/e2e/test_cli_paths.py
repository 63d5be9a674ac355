"""The other subcommands and config round trips, as a user runs them (``python cli.py ...``, real MNIST, few batches).

One chain of commands in one experiment folder:

1. ``fit ARGS --print_config`` prints the resolved configuration; ``fit --config printed.yaml`` trains (version_0),
   and saves the same configuration as its ``config.yaml``;
2. ``validate --config version_0/config.yaml --ckpt_path last`` re-runs with the config the run saved (nothing else
   given) and evaluates its ``last.ckpt``: the same images, and the accuracy its training ended with;
3. ``predict --ckpt_path last --model.compile true``: torch.compile'd forward passes give the eager network's
   predictions for the first test images.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from tests.conftest import run_cli

SAVE = "tests.e2e.test_cli_paths.SavePredictions"
BATCHES = 30


class SavePredictions(Callback):
    """Writes ``predict``'s outputs and whether the network ran compiled to ``<default_root_dir>/predictions.pt``."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.outputs.append({k: v.detach().cpu() for k, v in outputs.items()})

    def on_predict_end(self, trainer, pl_module) -> None:
        from torch._dynamo.utils import counters

        saved = {
            "pred": torch.cat([o["pred"] for o in self.outputs]),
            "prob": torch.cat([o["prob"] for o in self.outputs]),
            "compiled": pl_module.net._compiled_call_impl is not None,
            "graphs": counters["stats"]["unique_graphs"],
        }
        torch.save(saved, Path(trainer.default_root_dir) / "predictions.pt")


def _ok(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    return output


@pytest.fixture(scope="module")
def chain(mnist_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("cli_paths")
    root = work / "runs"
    args = [
        "--trainer.default_root_dir", str(root), "--data.data_dir", str(mnist_dir), "--data.batch_size", "64",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(BATCHES), "--trainer.limit_val_batches", "4",
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    printed = run_cli("fit", *args, "--print_config", cwd=work)
    _ok(printed)
    (work / "printed.yaml").write_text(printed.stdout)
    first = _ok(run_cli("fit", "--config", str(work / "printed.yaml"), cwd=work))
    saved_config = str(root / "version_0" / "config.yaml")
    validate = _ok(run_cli("validate", "--config", saved_config, "--ckpt_path", "last", cwd=work))
    predict = run_cli(
        "predict", "--trainer.default_root_dir", str(root), "--data.data_dir", str(mnist_dir), "--ckpt_path", "last",
        "--model.compile", "true", "--trainer.limit_predict_batches", "2", "--data.batch_size", "50",
        f"--trainer.callbacks+={SAVE}", cwd=work,
    )  # fmt: skip
    return {"work": work, "root": root, "printed": printed.stdout, "first": first, "validate": validate,
            "predict": _ok(predict)}  # fmt: skip


@pytest.mark.slow
def test_print_config_runs_and_is_what_the_run_saves(chain):
    root = chain["root"]
    printed = yaml.safe_load(chain["printed"])
    assert printed["trainer"]["limit_train_batches"] == BATCHES and printed["model"]["arch"] == "mnist_lenet"
    assert printed["trainer"]["default_root_dir"] == str(root)
    assert printed["trainer"]["logger"]["init_args"]["save_dir"] is None  # "the run folder", filled in at start
    saved = yaml.safe_load((root / "version_0" / "config.yaml").read_text())
    printed["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
    assert saved == printed  # what --print_config shows is what the run saved (with the run folder filled in)
    assert torch.load(root / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == BATCHES
    # fit, validate and predict each wrote one run folder (TensorBoard logs); only fit checkpoints
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0", "version_1", "version_2"]
    assert sorted(p.parent.name for p in root.glob("version_*/checkpoints")) == ["version_0"]


@pytest.mark.slow
def test_validate_with_the_saved_config_and_last_reports_the_accuracy_training_ended_with(chain):
    root, out = chain["root"], chain["validate"]
    assert (
        f"resume: {root / 'version_0' / 'checkpoints' / 'last.ckpt'} (--ckpt_path last: the newest last.ckpt)" in out
    ), out[-3000:]
    assert "val: evaluated 256/5000 images" in out, out[-3000:]  # the saved config's data and limits
    reported = float(re.search(r"val/acc1\W+([0-9.]+)", out).group(1))
    ckpt = torch.load(root / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    (score,) = [v["best_model_score"] for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert reported == pytest.approx(score.item(), abs=1e-6), (reported, score)
    assert 0.5 < reported < 1.0


@pytest.mark.slow
def test_predict_with_compile_gives_the_eager_networks_predictions(chain, mnist_dir):
    from datamodules.mnist import load_split
    from modules import ImageClassifier

    saved = torch.load(chain["root"] / "predictions.pt", weights_only=False)
    assert saved["compiled"] is True and saved["graphs"] >= 1  # torch.compile really ran the forward passes
    assert saved["pred"].shape == (100,) and saved["prob"].shape == (100, 10)
    assert torch.equal(saved["pred"], saved["prob"].argmax(dim=-1))
    torch.testing.assert_close(saved["prob"].sum(dim=-1), torch.ones(100))
    # the same checkpoint, eager, on the first 100 test images
    images, labels = load_split(mnist_dir, train=False)
    ckpt = torch.load(chain["root"] / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    model = ImageClassifier(**{k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")})
    model.load_state_dict(ckpt["state_dict"])
    with torch.no_grad():
        eager = model.eval()(images[:100]).softmax(dim=-1)
    torch.testing.assert_close(saved["prob"], eager, rtol=1e-4, atol=1e-5)
    assert (saved["pred"] == labels[:100]).float().mean().item() > 0.5  # a trained network's predictions
