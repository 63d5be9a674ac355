"""What a newcomer reads: the framework's noise is silenced at its source, and nothing else is."""

from __future__ import annotations

import logging
import sys
import warnings

from app.command import main
from app.quiet import silence_known_noise
from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.conftest import fast_trainer


def test_a_real_fit_says_no_tip_and_no_leafspec_deprecation(mnist_dir, tmp_path, caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        silence_known_noise()  # after "always", as the CLI installs it on top of Python's defaults
        trainer = fast_trainer(tmp_path, limit_train_batches=2, limit_val_batches=1)
        trainer.fit(ImageClassifier(arch="mnist_fast"), MNISTDataModule(data_dir=str(mnist_dir), batch_size=8))
    assert trainer.global_step == 2
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "litlogger" in m], said
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    # what remains is Lightning's other output: the filter is narrow
    logging.getLogger("lightning.pytorch.utilities.rank_zero").info("Seed set to 7")
    assert "Seed set to 7" in caplog.text


def test_tools_that_pass_args_are_not_warned_about_sys_argv(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["python -m tools.parity", "--steps", "5"])  # the tool's own command line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"], run=False)
    assert cli.config.trainer.default_root_dir == str(tmp_path)
    assert not [w for w in caught if "args parameter" in str(w.message)], [str(w.message) for w in caught]
