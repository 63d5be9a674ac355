"""The W&B logger's decisions, with the real wandb package and real environment variables/netrc files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jsonargparse import Namespace

from app.command import main
from app.loggers import TensorBoardLogger, WandbLogger, prepare_loggers, redact, wandb_mode
from tests.troubleshooting import assert_documented
from tests.wandb_reader import offline_runs, requires_wandb

ROOT = Path(__file__).resolve().parents[2]
WANDB_CONFIG = str(ROOT / "configs" / "logger" / "wandb.yaml")


@pytest.fixture
def clean_home(tmp_path, monkeypatch):
    """A user with no W&B credentials: empty HOME, no WANDB_* variables."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_offline_without_credentials_online_with_them(clean_home, monkeypatch):
    assert wandb_mode(None) == ("offline", "no W&B API key or login found")
    # what `wandb login` leaves behind: a netrc entry for the W&B host
    (clean_home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode(None)[0] == "online"
    # a self-hosted server is another host: the api.wandb.ai login does not count for it
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode(None)[0] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(None)[0] == "online"
    # the user's explicit choice wins over credentials: WANDB_MODE, then the config's `offline`
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None) == ("offline", "WANDB_MODE=offline")
    assert wandb_mode(False)[0] == "online" and wandb_mode(True)[0] == "offline"


@requires_wandb
def test_wandb_config_builds_tensorboard_and_wandb_in_the_run_folder(clean_home, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cli = main(["--config", WANDB_CONFIG, "--trainer.default_root_dir", str(tmp_path)], run=False)
    tb, wb = cli.trainer.loggers
    assert isinstance(tb, TensorBoardLogger) and isinstance(wb, WandbLogger)
    # TensorBoard first keeps the run folder layout (version_N/, config.yaml, checkpoints/)
    assert Path(tb.save_dir) == tmp_path and Path(wb.save_dir) == tmp_path
    assert wb.name == "from-env" and wb.mode == "offline"
    assert "group" not in wb._wandb_init  # single node: no group


@requires_wandb
def test_multi_node_jobs_get_a_group(clean_home, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    logger = Namespace(class_path="app.loggers.WandbLogger", init_args=Namespace(group=None, id=None))
    config = Namespace(trainer=Namespace(logger=[logger], num_nodes=2, default_root_dir=str(tmp_path)), ckpt_path=None)
    prepare_loggers(config, "fit")
    assert logger.init_args.group == "slurm-4242"
    logger.init_args.group = "mine"  # a configured group is kept
    prepare_loggers(config, "fit")
    assert logger.init_args.group == "mine"


def test_credentials_are_redacted_from_hyperparameters():
    params = {"trainer": {"logger": [{"init_args": {"api_key": "s3cret", "project": "p"}}]}, "WANDB_TOKEN": "t"}
    assert redact(params) == {
        "trainer": {"logger": [{"init_args": {"api_key": "<redacted>", "project": "p"}}]},
        "WANDB_TOKEN": "<redacted>",
    }


def test_without_wandb_installed_the_app_runs_and_the_wandb_logger_says_how_to_install(tmp_path):
    # a fresh interpreter where `import wandb` fails, as on a machine without the package
    code = f"""
import sys
sys.modules["wandb"] = None
from app.command import main
cli = main(["--trainer.default_root_dir", {str(tmp_path)!r}], run=False)
print("default config ok:", type(cli.trainer.logger).__name__)
from core.errors import UserError, error_line
try:
    main(["--config", {WANDB_CONFIG!r}, "--trainer.default_root_dir", {str(tmp_path)!r}], run=False)
except UserError as err:
    print("exit:")
    print(error_line(err))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "default config ok: TensorBoardLogger" in out.stdout
    assert "exit:\nerror: The W&B logger" in out.stdout and "pip install wandb" in out.stdout, out.stdout
    assert_documented(out.stdout, "wandb-missing")


@pytest.mark.slow
@requires_wandb
def test_unreachable_server_falls_back_to_offline_instead_of_failing_the_job(clean_home, tmp_path, monkeypatch, capsys):
    # a key, so the logger goes online, but nothing listens on the server's port (connection refused)
    monkeypatch.setenv("WANDB_API_KEY", "fake0key" + "7" * 32)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    import wandb

    logger = WandbLogger(save_dir=str(tmp_path), init_kwargs={"settings": {"init_timeout": 3}})
    assert logger.mode == "online"
    run = logger.experiment
    try:
        assert run.offline and logger.mode == "offline" and "online start failed" in logger.mode_reason
        run.log({"x": 1.0})
    finally:
        run.finish()
        wandb.teardown()  # waits for wandb's service to finish writing the run file
    (offline,) = offline_runs(tmp_path)
    assert offline.run_id == run.id and offline.keys >= {"x"}
