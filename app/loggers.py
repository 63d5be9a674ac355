"""Experiment tracking: TensorBoard by default, Weights & Biases on demand, one run per job, resumable.

- Loggers whose ``save_dir`` is left out write into ``trainer.default_root_dir`` (:func:`write_to_run_dir`), so a run's
  events, config and checkpoints share one folder that one option moves.
- :class:`WandbLogger` imports ``wandb`` lazily, goes offline by itself when no API key or login exists (and says how
  to ``wandb sync`` later), never prompts, and creates its run on global rank 0 only (Lightning's
  ``rank_zero_experiment``), so a job is one W&B run whatever the strategy and world size.
- :class:`TrackingConfigCallback` (the CLI's config callback) logs the resolved config and the environment as
  hyperparameters and saves the run identity (:class:`app.checkpoint.RunIdentity`: TensorBoard version, W&B run id,
  job, configuration) in every checkpoint; :func:`prepare_loggers` reads it from the resume decision before a resumed
  or SLURM-requeued job builds its loggers, so the job continues the same W&B run and TensorBoard version instead of
  starting new ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import netrc
import platform
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import lightning
import torch
import yaml
from lightning.pytorch import LightningModule, Trainer, loggers
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint import Resume, RunIdentity, jobs_of, run_folder, version_of
from core import env
from core.env import detect
from core.errors import UserError

SECRET_KEY = re.compile(r"(api[_-]?key|token|secret|password|credential)", re.IGNORECASE)
INSTALL_HINT = (
    "The W&B logger (configs/logger/wandb.yaml) needs the `wandb` package, which is not installed here. "
    "Fix: `pip install wandb` in this environment, or drop `--config configs/logger/wandb.yaml` to log to "
    "TensorBoard only."
)


class TensorBoardLogger(loggers.TensorBoardLogger):
    """Lightning's TensorBoardLogger; ``save_dir=None`` means the run folder (``trainer.default_root_dir``)."""

    def __init__(self, save_dir: str | None = None, name: str | None = "", **kwargs) -> None:
        super().__init__(save_dir=save_dir or ".", name=name, **kwargs)


def wandb_login_found(settings: env.Wandb | None = None) -> bool:
    """True when wandb would find credentials: ``WANDB_API_KEY``, an identity token file, or a netrc entry
    for the W&B host (what ``wandb login`` writes). Read here, not through wandb's private auth module,
    whose location changes between wandb releases."""
    settings = settings or env.wandb()
    if settings.has_key:
        return True
    host = urlsplit(settings.base_url or "https://api.wandb.ai").netloc
    home = Path.home()
    path = settings.netrc or next((str(p) for p in (home / ".netrc", home / "_netrc") if p.is_file()), None)
    try:
        found = netrc.netrc(path).authenticators(host) if path else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(found and found[2])


def wandb_mode(offline: bool | None) -> tuple[str, str]:
    """The W&B mode to run in and why: the config's ``offline`` wins, then ``WANDB_MODE``, then credentials."""
    if offline is not None:
        return ("offline", "offline: true in the logger config") if offline else ("online", "offline: false")
    settings = env.wandb()
    if settings.mode:
        return ("offline" if settings.mode == "dryrun" else settings.mode), f"WANDB_MODE={settings.mode}"
    if not wandb_login_found(settings):
        return "offline", "no W&B API key or login found"
    return "online", "credentials found"


class WandbLogger(loggers.WandbLogger):
    """Lightning's WandbLogger, made safe for batch jobs.

    Unset values fall back to wandb's own ``WANDB_*`` variables (``WANDB_PROJECT``, ``WANDB_ENTITY``,
    ``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ``WANDB_NAME``, ``WANDB_MODE``, ``WANDB_DIR`` ...).

    Args:
        project: W&B project (default: ``$WANDB_PROJECT``, else ``dptrain``).
        name: display name of the run.
        save_dir: where ``wandb/`` is written; ``None`` means the run folder (``trainer.default_root_dir``).
        entity: W&B user or team.
        group: run group; multi-node jobs get one automatically (see :func:`prepare_loggers`).
        tags: run tags.
        notes: run description.
        job_type: W&B job type, e.g. ``train``.
        id: run id to create or continue; a resumed job gets it from its checkpoint automatically.
        offline: ``None`` (auto): online when an API key or ``wandb login`` is found, else offline;
            ``True``/``False`` force it.
        log_model: log the checkpoints as W&B artifacts: ``True`` the best and last at the end of training,
            ``"all"`` every checkpoint when saved. Offline runs keep them for ``wandb sync``.
        checkpoint_name: name of the model artifact (default ``model-<run id>``).
        prefix: prefix for every metric key.
        init_kwargs: further ``wandb.init`` arguments (e.g. ``{settings: {init_timeout: 60}}``).
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        job_type: str | None = None,
        id: str | None = None,
        offline: bool | None = None,
        log_model: bool | Literal["all"] = False,
        checkpoint_name: str | None = None,
        prefix: str = "",
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            import wandb  # noqa: F401  (imported here so the app runs without wandb unless this logger is chosen)
        except ImportError as err:
            raise ModuleNotFoundError(INSTALL_HINT) from err
        self.mode, self.mode_reason = wandb_mode(offline)
        extra = {"entity": entity, "group": group, "tags": tags, "notes": notes, "job_type": job_type}
        super().__init__(
            name=name,
            save_dir=save_dir or ".",
            id=id,
            project=project or env.wandb().project or "dptrain",
            log_model=log_model,
            checkpoint_name=checkpoint_name,
            prefix=prefix,
            # our mode, not Lightning's ``offline=True``: that one forbids log_model and rewrites WANDB_MODE globally
            mode=self.mode,
            **{k: v for k, v in extra.items() if v is not None},
            **(init_kwargs or {}),
        )
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)  # wandb 0.31 warns about the key even when it is None

    @property
    @rank_zero_experiment
    def experiment(self):
        """The wandb run, created on global rank 0 at first use; other ranks get a no-op object."""
        creating = self._experiment is None
        if creating and self._save_dir:
            Path(self._save_dir).mkdir(parents=True, exist_ok=True)  # wandb falls back to /tmp when it is missing
        try:
            run = super().experiment
        except Exception as err:  # wandb.errors.CommError & co: server unreachable or key refused, after init_timeout
            if self.mode != "online" or type(err).__module__.split(".")[0] != "wandb":
                raise
            # a batch job must not die (or retry forever) for its tracker: record offline, sync later
            self.mode, self.mode_reason = "offline", f"online start failed: {str(err).splitlines()[0][:200]}"
            self._wandb_init["mode"] = "offline"
            run = super().experiment
        if creating and self.mode == "offline":
            sync_dir = getattr(getattr(run, "settings", None), "sync_dir", None) or self._save_dir
            rank_zero_info(
                f"W&B: offline ({self.mode_reason}); run {run.id} is saved in {sync_dir}; "
                f"upload it later with: wandb sync {sync_dir}"
            )
        return run


def redact(value: Any) -> Any:
    """A copy of ``value`` where every entry whose key looks like a credential reads ``<redacted>``."""
    if isinstance(value, dict):
        return {k: "<redacted>" if SECRET_KEY.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def environment(trainer: Trainer) -> dict[str, Any]:
    """What ran the job: world size, nodes, strategy, precision, devices (of rank 0's node), versions."""
    strategy = trainer.strategy
    devices = list(getattr(strategy, "parallel_devices", None) or [strategy.root_device])
    names = [torch.cuda.get_device_name(d) if d.type == "cuda" else f"{d.type} ({platform.machine()})" for d in devices]
    cluster = getattr(strategy, "cluster_environment", None)
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "strategy": type(strategy).__name__,
        "precision": trainer.precision,
        "accelerator": type(trainer.accelerator).__name__,
        "device_names": names,
        "cluster_environment": type(cluster).__name__ if cluster is not None else None,
        **jobs_of(detect()),  # a restart with nothing saved continues this run (the run identity's job ids)
        "torch": str(torch.__version__),  # a TorchVersion would be written as a Python object tag
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def resolved_config(parser: Any, config: Any) -> dict[str, Any]:
    """A run's whole configuration as plain data: one jsonargparse dump (each validates the whole configuration)."""
    return yaml.safe_load(parser.dump(config, skip_unset=False))


def config_text(resolved: dict[str, Any]) -> str:
    """A :func:`resolved_config` as YAML, credentials redacted: what checkpoints keep of it."""
    return yaml.safe_dump(redact(resolved))


class TrackingConfigCallback(SaveConfigCallback):
    """Lightning's config callback (``config.yaml`` in the run folder), plus two things trackers need.

    On rank 0 at setup it logs the resolved config and :func:`environment` as hyperparameters to every logger
    (credentials redacted). Into every checkpoint it writes the run identity (:class:`app.checkpoint.RunIdentity`:
    TensorBoard version folder, W&B run id, the job, the configuration as YAML with credentials redacted), under the
    record's own key, whatever this class is called: :func:`prepare_loggers` continues the loggers from it, and
    :class:`app.checkpoint.changed_settings.ChangedSettings` compares a resumed run's configuration with it.
    """

    _config_text: str | None = None
    _jobs: dict[str, str | None] | None = None
    _resolved: dict[str, Any] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._resolved = resolved_config(self.parser, self.config)  # for the checkpoints and the hyperparameters
        self._config_text = config_text(self._resolved)
        self._jobs = jobs_of(detect())  # what a restarted worker group and a requeued job look for
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        params = redact({**(self._resolved or {}), "env": environment(trainer)})
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        found: dict[str, Any] = {}
        for logger in trainer.loggers:
            if isinstance(logger, loggers.TensorBoardLogger) and "tensorboard_version" not in found:
                version = logger.version
                found["tensorboard_version"] = version if isinstance(version, str) else f"version_{version}"
            elif isinstance(logger, loggers.WandbLogger) and "wandb_id" not in found and logger.version:
                found["wandb_id"] = logger.version
        RunIdentity(**found, **(self._jobs or {}), config=self._config_text).save_in(checkpoint)


def logger_configs(config: Any) -> list:
    """The ``class_path`` + ``init_args`` entries of ``trainer.logger`` (none for ``false`` or a bare instance)."""
    loggers = config.trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    return [lg for lg in loggers if hasattr(lg, "init_args")]


RUN_DIR = "<run folder>"  # stands for trainer.default_root_dir until the config is complete (write_to_run_dir)


def run_dir_for_loggers(args: list[str]) -> list[str]:
    """``args`` where a ``--trainer.logger CLASS`` whose ``save_dir`` is required but not given writes into the run
    folder, with the run folder's layout (``name ""``: ``version_N/`` directly in it), like the app's own loggers.

    Lightning's ``CSVLogger`` and ``TensorBoardLogger`` require ``save_dir``; without it jsonargparse refuses the
    whole ``trainer.logger`` value with a message about bools. The folder is not known until every config file and
    option is read, so :data:`RUN_DIR` stands for it and :func:`write_to_run_dir` puts it in.
    """
    args = list(args)
    for i in reversed(range(len(args))):
        key, eq, value = args[i].partition("=")
        if key != "--trainer.logger" or (not eq and i + 1 >= len(args)):
            continue
        end = i + 1 if eq else i + 2
        given = {arg.partition("=")[0].replace(".init_args.", ".") for arg in args[end:]}
        params = _init_parameters(value if eq else args[i + 1])
        save_dir = params.get("save_dir")
        if save_dir is None or save_dir.default is not inspect.Parameter.empty or "--trainer.logger.save_dir" in given:
            continue
        extra = ["--trainer.logger.save_dir", RUN_DIR]
        if "name" in params and "--trainer.logger.name" not in given:
            extra += ["--trainer.logger.name", ""]
        args[end:end] = extra
    return args


def _init_parameters(class_path: str) -> dict[str, inspect.Parameter]:
    """The ``__init__`` parameters of the logger class ``class_path`` names (a short name is Lightning's); none for
    anything that is not an importable class (``false``, a dict, a typo the parser will name)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "lightning.pytorch.loggers"), name)
        return dict(inspect.signature(cls).parameters) if isinstance(cls, type) else {}
    except (ImportError, AttributeError, ValueError, TypeError):
        return {}


def write_to_run_dir(config: Any) -> None:
    """A logger configured without ``save_dir`` writes into ``trainer.default_root_dir``: one folder to set."""
    root = str(run_folder(config.trainer.default_root_dir))
    for logger in logger_configs(config):
        if "save_dir" in logger.init_args and logger.init_args.save_dir in (None, RUN_DIR):
            logger.init_args.save_dir = root


def continue_run_of(config: Any, last: Path) -> None:
    """The loggers continue the version of the run ``last`` (``version_N/checkpoints/last.ckpt``) belongs to, so a
    resumed run keeps writing to the same TensorBoard version and run folder."""
    version = version_of(last)
    for logger in logger_configs(config):
        if "version" in logger.init_args and version is not None:  # a last.ckpt of no version: a new version
            logger.init_args.version = version


def prepare_loggers(config, subcommand: str | None, resume: Resume | None = None) -> None:
    """Fills in logger settings the CLI knows before the loggers exist (called by the CLI on every rank).

    - Choosing the W&B logger without ``wandb`` installed stops here with the install command.
    - A multi-node job gets a W&B ``group`` (``slurm-<job id>`` / ``torchrun-<run id>``) unless one is set; so does
      each task of a job array (``slurm-array-<array job id>``).
    - ``fit`` resuming from a checkpoint of this run folder (``resume``: the resume decision) continues the
      checkpoint's TensorBoard version and W&B run id. A checkpoint from another folder starts new ones (fine-tuning
      someone else's weights is a new run). A restart with nothing saved yet continues the TensorBoard version its
      job started (``resume.run_folder``).
    """
    configured = logger_configs(config)
    wandb_cfgs = [lg for lg in configured if lg.class_path.rsplit(".", 1)[-1] == "WandbLogger"]
    tb_cfgs = [lg for lg in configured if lg.class_path.rsplit(".", 1)[-1] == "TensorBoardLogger"]
    if wandb_cfgs and importlib.util.find_spec("wandb") is None:
        # here, not only in WandbLogger: jsonargparse would bury the logger's message in a "Union subtypes" error
        raise UserError(INSTALL_HINT, help="wandb-missing")
    _group_the_nodes(int(config.trainer.get("num_nodes") or 1), wandb_cfgs)
    if subcommand != "fit" or resume is None:
        return
    if resume.path is not None:
        _continue_the_checkpoints_run(config, resume, tb_cfgs, wandb_cfgs)
    elif resume.run_folder is not None:  # a restart before any save: the folder its job started
        for lg in tb_cfgs:
            if lg.init_args.get("version") is None:
                lg.init_args.version = resume.run_folder.name


def _group_the_nodes(nodes: int, wandb_cfgs: list) -> None:
    """A multi-node job's W&B runs share a group (``slurm-<job id>`` / ``torchrun-<run id>``) unless one is set; the
    runs of a grid's job array (one per task, any number of nodes) share ``slurm-array-<array job id>``."""
    if not wandb_cfgs or env.wandb().run_group:
        return
    launch = detect()
    if nodes <= 1 and not launch.array_job:
        return
    job, run = launch.slurm_job, launch.torchrun_job or "none"
    group = f"slurm-{job}" if job else (f"torchrun-{run}" if run != "none" else f"{nodes}-nodes")
    group = f"slurm-array-{launch.array_job}" if launch.array_job else group
    for lg in wandb_cfgs:
        if not lg.init_args.get("group"):
            lg.init_args.group = group


def _continue_the_checkpoints_run(config: Any, resume: Resume, tb_cfgs: list, wandb_cfgs: list) -> None:
    """A fit resuming from a checkpoint of this run folder continues its TensorBoard version and W&B run id."""
    checkpoint = resume.path
    root = run_folder(config.trainer.get("default_root_dir")).resolve()
    if not checkpoint.is_file() or root not in checkpoint.resolve().parents:
        return
    record = resume.identity
    for lg in tb_cfgs:
        if lg.init_args.get("version") is None and record.tensorboard_version:
            lg.init_args.version = record.tensorboard_version
    for lg in wandb_cfgs:
        if not lg.init_args.get("id") and record.wandb_id:
            lg.init_args.id = record.wandb_id
    identity = {k: v for k, v in record.as_dict().items() if k != "config"}
    if identity:
        names = {"tensorboard_version": "TensorBoard", "wandb_id": "W&B run", "torchrun_job": "torchrun job",
                 "slurm_job": "SLURM job"}  # fmt: skip
        what = " and ".join(f"{names.get(k, k)} {v}" for k, v in identity.items())
        rank_zero_info(f"Resuming from {checkpoint}: continuing {what}")
