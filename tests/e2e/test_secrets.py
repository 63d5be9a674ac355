"""No secret from the environment ends up in anything a run writes.

A real short fit with TensorBoard and W&B (offline) runs with fake credentials in the environment, the usual names a
training node has set (W&B, Hugging Face, GitHub, AWS). Then every byte of every file under the run folder (config,
``hparams.yaml``, TensorBoard events, checkpoints, the W&B run files) and everything the run printed is searched for
each fake value. The environment *is* logged as hyperparameters (``app.loggers.environment``), so this is the check
that it is the job's description and not ``os.environ``. ``tests/e2e/test_tracking_resume.py`` does the same for the
W&B key across a killed and resumed job in separate processes.
"""

from __future__ import annotations

import pytest

from app.command import main
from tests.conftest import ROOT
from tests.wandb_reader import offline_runs, requires_wandb

FAKES = {
    "WANDB_API_KEY": "fake0key" + "1" * 32,
    "HF_TOKEN": "hf_fakeTOKEN" + "2" * 24,
    "GITHUB_TOKEN": "ghp_fakeTOKEN" + "3" * 23,
    "AWS_ACCESS_KEY_ID": "AKIAFAKE" + "4" * 12,
    "AWS_SECRET_ACCESS_KEY": "fakeSECRET" + "5" * 30,
}


@pytest.mark.slow
@requires_wandb
def test_no_secret_in_any_file_the_run_writes(mnist_dir, tmp_path, monkeypatch, capfd):
    import wandb

    for name, value in FAKES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "run"
    try:
        main([
            "fit", "--config", str(ROOT / "configs" / "logger" / "wandb.yaml"), "--trainer.default_root_dir", str(root),
            "--data.data_dir", str(mnist_dir), "--data.batch_size", "16", "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
            "--trainer.log_every_n_steps", "1", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false",
        ])  # fmt: skip
    finally:
        wandb.finish()
        wandb.teardown()  # waits for wandb's service to finish writing the run file
    printed = "".join(capfd.readouterr())

    files = [p for p in root.rglob("*") if p.is_file()]
    kinds = {p.name for p in files} | {p.suffix for p in files}
    # what was searched: the resolved config, hyperparameters, TensorBoard events, checkpoints, the W&B run
    assert {"config.yaml", "hparams.yaml", "last.ckpt", ".wandb"} <= kinds, sorted(kinds)
    assert any(p.name.startswith("events.out.tfevents") for p in files)
    hparams = next(p for p in files if p.name == "hparams.yaml").read_text()
    assert len(offline_runs(root)) == 1 and "world_size: 1" in hparams  # the run and its environment were logged
    leaks = {name: [str(p) for p in files if value.encode() in p.read_bytes()] for name, value in FAKES.items()}
    leaks = {name: where for name, where in leaks.items() if where}
    printed_leaks = [name for name, value in FAKES.items() if value in printed]
    assert not leaks and not printed_leaks, (leaks, printed_leaks)
