"""Do the parallel modes train the same model? ``python -m tools.parity --config CONFIG --steps 5``.

Runs the config's model for a few optimizer steps in every mode available here and prints, per mode, the largest
parameter difference against a single-device run that sees the same global batches. The modes are the registered
strategies whose layout (``core.layout``) claims exact parity, unless ``--modes`` names others. They run
together in one ``torchrun`` job (N processes: one per GPU, or 2 gloo processes on CPU; on GPUs a mode whose processes
need GPUs of their own, ``ddp_mp``, runs in a job of its own, N / devices_per_process processes, and a failed job
loses only its modes; a one-process mode, ``dp``, runs beside the references on 2+ GPUs); the single-device
reference then replays each global batch as the concatenation of the ranks' shards, in rank order, built from the
very ``DistributedSampler`` settings (seed, shuffle, per-rank batch, repeated augmentation) the job reported, through
the DataModule's own batch hooks (GPU decoding, normalising, mixing: what is drawn per device is drawn per shard, as
each rank drew it), with the global batch as its batch. Dropout is switched off in all
runs (its random masks cannot match across a different split of the batch). With BatchNorm each rank normalises by
its own shard's statistics, so the modes are also compared with ``ddp``, the expected behaviour, not only with the
single device (with ``trainer.sync_batchnorm`` every rank normalises by the global batch: the single device is the
reference again). The job also checks the collectives (``app.collectives``: send/recv, broadcast, scatter, ...) and the
sampler's shards. With the weights' moving average (``--ema``), the modes are compared on the average (the weights a
run ends with) and on the training weights.

Extra command-line arguments after ``--`` go to the config, e.g. ``-- --model.arch resnet18 --data.batch_size 8``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import app.strategies  # noqa: F401  (registers the app's strategy names)
from app import command as app_cli
from app.callbacks import EMA
from app.collectives import check_collectives
from app.launch.group import end_process_group
from app.strategies.modes import REFERENCE, declared_modes, parity_modes
from app.sync_batchnorm import with_sync_batchnorm
from core.device import AUTO, auto_precision, on_cuda
from core.layout import layout_of
from datamodules.resumable import ResumableSampler, SeededDataset
from tools.torchrun import run_torchrun_job

gc.freeze()  # as cli.py does: what the imports left, out of the cyclic collector's reach (results/startup.md)

_QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def build(args: list[str], workdir: Path) -> tuple[Any, Any, Any]:
    """The config's model (dropout off), datamodule and settings, through the app's own CLI."""
    built = app_cli.main([*args, "--trainer.default_root_dir", str(workdir), "--trainer.logger", "false"], run=False)
    for module in built.model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return built.model, built.datamodule, built.config


def resolved_precision(precision: Any, accelerator: Any) -> Any:
    """The config's precision, ``auto`` resolved as the app's Trainer does (the ImageNet recipe's)."""
    return auto_precision(on_cuda(accelerator)) if precision == AUTO else precision


class TrainingWeights(Callback):
    """The weights when training ends, before the moving average is copied into the model (it comes after)."""

    flat: torch.Tensor | None = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.flat = _flat(list(pl_module.parameters()))


def _trainer(root: Any, steps: int, **kwargs: Any) -> Any:
    from lightning.pytorch import Trainer

    config = root.trainer
    ema = EMA(**(root.get("ema") or {}))
    averaging = [TrainingWeights(), ema] if ema.enabled else []  # the training weights only matter beside an average
    kwargs["callbacks"] = [*averaging, *kwargs.get("callbacks", [])]
    plugins = kwargs.pop("plugins", [])  # a precision plugin given here replaces the config's precision
    settings = {
        "max_steps": steps,
        "max_epochs": -1,
        "limit_train_batches": config.limit_train_batches,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "accumulate_grad_batches": config.accumulate_grad_batches,
        "gradient_clip_val": config.gradient_clip_val,
        **({} if plugins else {"precision": resolved_precision(config.precision, kwargs.get("accelerator"))}),
        "sync_batchnorm": config.sync_batchnorm,
        "plugins": with_sync_batchnorm(plugins) if config.sync_batchnorm else plugins or None,  # as app.command does
        **_QUIET,
    }
    return Trainer(**settings, **kwargs)


def import_named(scenarios: list[dict]) -> None:
    """Imports the modules a scenario names under ``imports`` (e.g. one that registers another strategy), in the
    torchrun job's processes as in this one."""
    import importlib

    for module in dict.fromkeys(m for s in scenarios for m in s.get("imports", [])):
        importlib.import_module(module)


def _scenario_extras(scenario: dict, device: str) -> dict[str, Any]:
    """Optional checks of a scenario: ``callbacks`` given as ``module:Class``, and ``fp16_scaler``: 16-mixed with a
    GradScaler even on CPU (where Lightning would choose bf16), to watch the skip decisions of every rank."""
    import importlib

    extras: dict[str, Any] = {}
    if scenario.get("callbacks"):
        classes = [getattr(importlib.import_module(m), c) for m, c in (p.split(":") for p in scenario["callbacks"])]
        extras["callbacks"] = [cls() for cls in classes]
    if scenario.get("fp16_scaler"):
        from lightning.pytorch.plugins.precision import MixedPrecision

        extras["plugins"] = [MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device))]
    return extras


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    # float64: exact for every training dtype, so a 64-true scenario's differences are not rounded away
    return torch.cat([t.detach().double().cpu().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _digest(tensors: list[torch.Tensor] | torch.Tensor) -> str:
    """SHA-256 of the tensors flattened as :func:`_flat` does (or of a tensor :func:`_flat` returned)."""
    flat = tensors if isinstance(tensors, torch.Tensor) else _flat(tensors)
    return hashlib.sha256(flat.numpy()).hexdigest()  # the array's own buffer: no copy of its bytes


def _same_on_all_ranks(value: Any) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def _sampler_facts(loader: DataLoader) -> dict[str, Any]:
    """What the reference needs to replay the shards, and whether they are disjoint and move with the epoch."""
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        return {"distributed_sampler": False}
    final_epoch = sampler.epoch
    shards = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    sampler.set_epoch(final_epoch)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shards)
    epoch0 = [set(s[0]) for s in everyone]
    return {
        "distributed_sampler": True,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
        "batch_size": loader.batch_size,
        "repeats": getattr(sampler, "repeats", 1),
        "last_epoch_seen": final_epoch,
        "disjoint": sum(len(s) for s in epoch0) == len(set().union(*epoch0)),
        "epochs_differ": all(s[0] != s[1] for s in everyone),
    }


def _facts(trainer: Any, model: nn.Module, flat: torch.Tensor, initial: torch.Tensor, checkpoint: Path) -> dict:
    """What one mode's run left on this rank (the same on every rank, or the mode is broken); ``flat``: the model's
    parameters as :func:`_flat` returns them."""
    facts = {
        "ranks_identical": _same_on_all_ranks(_digest(flat)),
        "steps": trainer.global_step,
        "moved": (flat - initial).abs().max().item(),
    }
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        facts["loss_scale"] = scaler.get_scale()
        facts["loss_scale_same_on_ranks"] = _same_on_all_ranks(facts["loss_scale"])
    if hasattr(trainer.strategy, "sync_buffers"):  # allreduce: a checkpoint makes BatchNorm buffers agree
        trainer.save_checkpoint(checkpoint)
        facts["buffers_identical"] = _same_on_all_ranks(_digest(list(model.buffers())))
        facts["checkpoint"] = str(checkpoint)
    return facts


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (a compiled scenario must have made some)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run_scenario(scenario: dict, steps: int, nproc: int, workdir: Path, accelerator: str) -> dict[str, Any]:
    """Every mode of one scenario from the same initial model; rank 0 saves each mode's parameters."""
    overrides = ["--trainer.devices", str(nproc), "--trainer.strategy", "ddp"]
    model0, datamodule, config = build([*scenario["args"], *overrides], workdir)
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model0.modules())
    synced = bool(config.trainer.sync_batchnorm)
    out: dict[str, Any] = {"modes": {}, "batchnorm": batchnorm, "sync_batchnorm": synced}
    steps = scenario.get("steps", steps)
    initial = _flat(list(model0.parameters()))
    for mode in scenario["modes"]:
        # the previous mode's trainer, model and average sit in reference cycles: the collector's own schedule (it
        # counts objects, not bytes) let a rank of this job grow past 11 GB
        gc.collect()
        model = copy.deepcopy(model0)
        extras = _scenario_extras(scenario, accelerator)
        trainer = _trainer(config, steps, accelerator=accelerator, devices=nproc, strategy=mode, **extras)
        graphs = _compiled_graphs()
        trainer.fit(model, datamodule=datamodule)
        if "sampler" not in out:
            out["sampler"] = _sampler_facts(trainer.train_dataloader)
        flat = _flat(list(model.parameters()))  # the average, for a run that kept one
        out["modes"][mode] = _facts(trainer, model, flat, initial, workdir / f"{scenario['name']}.{mode}.ckpt")
        if averaged(trainer):  # how far the average is from the training weights: what its comparison can see
            out["modes"][mode]["average_vs_training"] = (flat - training_weights(trainer)).abs().max().item()
        if any(m._compiled_call_impl is not None for m in model.modules()):  # torch.compile made (or reused) graphs
            out["modes"][mode]["compiled_graphs"] = _compiled_graphs() - graphs
        if dist.get_rank() == 0:
            torch.save(flat, workdir / f"{scenario['name']}.{mode}.pt")
            if averaged(trainer):
                torch.save(training_weights(trainer), workdir / f"{scenario['name']}.{mode}.training.pt")
    return out


def averaged(trainer: Any) -> bool:
    """Whether the run kept a moving average of its weights (and ended with it)."""
    return any(isinstance(c, EMA) for c in trainer.callbacks)


def training_weights(trainer: Any) -> torch.Tensor:
    return next(c.flat for c in trainer.callbacks if isinstance(c, TrainingWeights))


def worker(spec_path: str) -> None:
    """One rank of the torchrun job: every scenario in every distributed mode; rank 0 writes the results."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.fabric.utilities.distributed import _init_dist_connection

    spec = json.loads(Path(spec_path).read_text())
    import_named(spec["scenarios"])
    workdir, nproc = Path(spec["workdir"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and spec["accelerator"] != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # the process group comes up exactly as DDPStrategy brings it up; the strategies then find it initialised
    _init_dist_connection(TorchElasticEnvironment(), "nccl" if cuda else "gloo")
    # a point-to-point ring needs 2+ ranks; the collectives are checked once, in the one-process-per-device job
    checks = check_collectives(device) if spec.get("collectives", True) and nproc > 1 else {}
    results: dict[str, Any] = {"collectives": checks, "scenarios": {}}
    for scenario in spec["scenarios"]:
        accelerator = "cuda" if cuda else "cpu"
        results["scenarios"][scenario["name"]] = _run_scenario(scenario, spec["steps"], nproc, workdir, accelerator)
    if dist.get_rank() == 0:
        Path(spec.get("results", workdir / "results.json")).write_text(json.dumps(results, indent=1))
    dist.barrier()
    end_process_group()


class GlobalBatchSampler:
    """Yields, per step, the concatenation of what each rank's ``DistributedSampler`` gives it, in rank order; with
    ``repeats`` the ranks' repeated-augmentation positions; ``keyed``: as ``(position, epoch)`` keys for a
    :class:`~datamodules.resumable.SeededDataset` (each sample's augmentations are those of its epoch)."""

    def __init__(
        self, length: int, world: int, batch_size: int, seed: int, shuffle: bool, repeats: int = 1, keyed: bool = False
    ) -> None:
        self.samplers = [
            ResumableSampler(range(length), num_replicas=world, rank=r, seed=seed, repeats=repeats)
            if repeats > 1
            else DistributedSampler(range(length), num_replicas=world, rank=r, shuffle=shuffle, seed=seed)
            for r in range(world)
        ]
        self.batch_size, self.keyed = batch_size, keyed
        self.sampler = self  # Lightning calls ``batch_sampler.sampler.set_epoch(epoch)`` each epoch, as for the ranks

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.samplers[0]) / self.batch_size)

    def __iter__(self):
        shards, epoch = [list(s) for s in self.samplers], self.samplers[0].epoch
        for start in range(0, len(shards[0]), self.batch_size):
            batch = [i for shard in shards for i in shard[start : start + self.batch_size]]
            yield [(i, epoch) for i in batch] if self.keyed else batch


def run_single(
    scenario: dict, facts: dict, world: int, steps: int, workdir: Path, strategy: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The single-device reference (or ``dp`` over ``world`` GPUs) on the global batches; returns its parameters, and
    its training weights when it kept a moving average (None otherwise)."""
    # a scenario's ``reference`` arguments change the reference only (a compiled mode against the eager model); its
    # batch is the global batch (what the lr scaling and the average's decay read)
    accumulate = build_accumulate(scenario)
    args = [*scenario["args"], *scenario.get("reference", []), "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--data.global_batch_size", str(world * facts["batch_size"] * accumulate)]  # fmt: skip
    model, datamodule, config = build(args, workdir)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    keyed = isinstance(loader.dataset, SeededDataset)
    batches = GlobalBatchSampler(
        len(loader.dataset), world, facts["batch_size"], facts["seed"], facts["shuffle"], facts.get("repeats", 1), keyed
    )
    loader = DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn)
    cuda = torch.cuda.is_available() and config.trainer.accelerator != "cpu"
    devices = world if layout_of(strategy).one_process else 1
    if not layout_of(strategy).one_process:  # (dp says itself how it splits a batch over its devices)
        datamodule.replay_shards = world
    trainer = _trainer(config, steps, accelerator="cuda" if cuda else "cpu", devices=devices, strategy=strategy)
    # the global batches go through the DataModule's own batch hooks (decoding, normalising, mixing); its validation
    # loader only says what the model's validation_step is for: limit_val_batches=0 never runs it
    datamodule.train_dataloader = lambda: loader
    trainer.fit(model, datamodule=datamodule)
    return _flat(list(model.parameters())), training_weights(trainer) if averaged(trainer) else None


def build_accumulate(scenario: dict) -> int:
    """The scenario's ``--trainer.accumulate_grad_batches`` (1 when not given)."""
    args = scenario["args"]
    at = args.index("--trainer.accumulate_grad_batches") if "--trainer.accumulate_grad_batches" in args else -1
    return int(args[at + 1]) if at >= 0 else 1


def jobs(modes: list[str], nproc: int, gpus: int) -> dict[int, list[str]]:
    """Processes -> the modes that run in one torchrun job with that many. On GPUs (``nproc`` = the GPUs used) a mode
    whose process drives ``k`` GPUs gets ``nproc // k`` processes, in a job of its own; on CPU all share ``nproc``.
    """
    out: dict[int, list[str]] = {}
    for mode in modes:
        layout = layout_of(mode, nproc)
        per_process = layout.devices_per_process if layout.needs_process_gpus else 1
        n = max(1, nproc // per_process) if gpus >= 2 else nproc
        out.setdefault(n, []).append(mode)
    return out


def _run_job(scenarios: list[dict], steps: int, nproc: int, workdir: Path, accelerator: str, main: bool) -> dict:
    """One torchrun job of ``nproc`` processes over the scenarios; raises RuntimeError with its output if it fails."""
    spec = {"scenarios": scenarios, "steps": steps, "workdir": str(workdir), "accelerator": accelerator}
    spec |= {"collectives": main, "results": str(workdir / f"results-{nproc}.json")}
    spec_path = workdir / f"spec-{nproc}.json"
    spec_path.write_text(json.dumps(spec))
    args = ["--worker", str(spec_path)]
    return run_torchrun_job("tools.parity", args, nproc, Path(spec["results"]), "parity")


def compare(scenarios: list[dict], steps: int, nproc: int, workdir: Path, accelerator: str = "auto") -> dict:
    """Runs the torchrun job(s) and the references; returns the jobs' facts with ``max_diff_vs_single``/``_vs_ddp``.

    Modes needing another process count (``ddp_mp`` on GPUs) run in a job of their own; a job that fails records
    ``error`` for its modes and the other jobs' results are kept. Raises RuntimeError only if every job failed.
    """
    import_named(scenarios)
    gpus = torch.cuda.device_count() if accelerator != "cpu" else 0  # nproc = GPUs used, when there are 2+
    results, worlds = _run_jobs(scenarios, steps, nproc, workdir, accelerator, gpus)
    for scenario in scenarios:
        out, samplers = results["scenarios"][scenario["name"]], worlds[scenario["name"]]
        _compare_scenario(scenario, out, samplers, steps, nproc, workdir, gpus)
    return results


def _run_jobs(
    scenarios: list[dict], steps: int, nproc: int, workdir: Path, accelerator: str, gpus: int
) -> tuple[dict, dict[str, dict[int, dict]]]:
    """Every job of :func:`jobs`; returns their facts and, per scenario, the sampler facts per world size."""
    results: dict[str, Any] = {"collectives": {}, "scenarios": {s["name"]: {"modes": {}} for s in scenarios}}
    worlds: dict[str, dict[int, dict]] = {s["name"]: {} for s in scenarios}
    failures = []
    planned = jobs(list(dict.fromkeys(m for s in scenarios for m in s["modes"])), nproc, gpus)
    for n, modes in planned.items():
        subset = [{**s, "modes": [m for m in s["modes"] if m in modes]} for s in scenarios]
        subset = [s for s in subset if s["modes"]]
        try:
            job = _run_job(subset, steps, n, workdir, accelerator, main=n == nproc)
        except RuntimeError as err:
            failures.append(str(err))
            for s in subset:
                for mode in s["modes"]:
                    results["scenarios"][s["name"]]["modes"][mode] = {"error": str(err)[-2000:], "world": n}
            continue
        results["collectives"] |= job["collectives"]
        for name, out in job["scenarios"].items():
            worlds[name][n] = out["sampler"]
            results["scenarios"][name].setdefault("sampler", out["sampler"])
            for key in ("batchnorm", "sync_batchnorm"):  # for the table's BatchNorm note
                results["scenarios"][name].setdefault(key, out[key])
            for mode, facts in out["modes"].items():
                results["scenarios"][name]["modes"][mode] = {**facts, "world": n}
    if len(failures) == len(planned):
        raise RuntimeError("\n".join(failures))
    return results, worlds


def _compare_scenario(
    scenario: dict, out: dict, samplers: dict[int, dict], steps: int, nproc: int, workdir: Path, gpus: int
) -> None:
    """Adds each mode's largest difference against the single device (same world size) and against ``ddp``.

    On 2+ GPUs the one-process modes (``dp``) join here: one process over the ``nproc`` GPUs, on the global batches.
    """
    references, steps = {}, scenario.get("steps", steps)
    if not scenario.get("fp16_scaler"):
        for n, sampler in samplers.items():
            references[n] = run_single(scenario, sampler, n, steps, workdir)
    name = scenario["name"]
    if gpus >= 2 and nproc in references:
        for mode in one_process_modes():
            params, training = run_single(scenario, samplers[nproc], nproc, steps, workdir, mode)
            torch.save(params, workdir / f"{name}.{mode}.pt")
            if training is not None:
                torch.save(training, workdir / f"{name}.{mode}.training.pt")
            out["modes"][mode] = {"ranks_identical": True, "world": nproc}  # one process, nproc GPUs
    reference = workdir / f"{name}.{REFERENCE}.pt"
    for mode, facts in out["modes"].items():
        if "error" in facts:
            continue
        params = torch.load(workdir / f"{name}.{mode}.pt")
        single, single_training = references.get(facts["world"], (None, None))
        facts["max_diff_vs_single"] = None if single is None else (params - single).abs().max().item()
        trained = workdir / f"{name}.{mode}.training.pt"
        if single_training is not None and trained.exists():  # the moving average's run: its training weights too
            facts["training_max_diff_vs_single"] = (torch.load(trained) - single_training).abs().max().item()
        if reference.exists() and out["modes"].get(REFERENCE, {}).get("world") == facts["world"]:
            facts["max_diff_vs_ddp"] = (params - torch.load(reference)).abs().max().item()


def one_process_modes() -> list[str]:
    """The registered modes whose one process drives every GPU (``dp``): compared only on 2+ GPUs."""
    from lightning.pytorch.strategies import StrategyRegistry

    return [name for name in StrategyRegistry if layout_of(name).one_process]


def table(results: dict) -> str:
    checks = results["collectives"]
    lines = ["collectives: " + (", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()) or "not run")]
    for name, out in results["scenarios"].items():
        sampler = out.get("sampler", {})
        lines.append(
            f"\n[{name}] shards disjoint: {sampler.get('disjoint')}, change with the epoch: "
            f"{sampler.get('epochs_differ')}\n{'mode':<22}{'max |diff| vs single':>22}{'vs ddp':>12}  ranks identical"
        )
        for mode, facts in out["modes"].items():
            if "error" in facts:
                lines.append(f"{mode:<22}FAILED ({facts['world']} processes): {facts['error'].strip()[-300:]}")
                continue
            vs_single, vs_ddp = (facts.get(k) for k in ("max_diff_vs_single", "max_diff_vs_ddp"))
            scale = f"  (loss scale {facts['loss_scale']:g})" if "loss_scale" in facts else ""
            if facts.get("training_max_diff_vs_single") is not None:  # vs single: the average; here its training
                scale += f"  (moving average; training weights {facts['training_max_diff_vs_single']:.3e})"
            lines.append(
                f"{mode:<22}{'-' if vs_single is None else f'{vs_single:.3e}':>22}"
                f"{'-' if vs_ddp is None else f'{vs_ddp:.3e}':>12}  {facts['ranks_identical']}{scale}"
            )
        if out.get("sync_batchnorm"):
            lines.append(
                "SyncBatchNorm: every rank normalises with the statistics of the whole global batch, as the single "
                "device does, so 'vs single' is the column to read."
            )
        elif out.get("batchnorm"):
            lines.append(
                "This network has BatchNorm: each rank normalises with its own shard's batch statistics, while the "
                "single device sees the whole global batch, so 'vs single' is not 0 by design. Read 'vs ddp': every "
                "mode must match ddp to float rounding (with a network without BatchNorm, e.g. "
                "-- --model.arch mnist_cnn, 'vs single' is the column to read)."
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line; ``--modes`` defaults to every registered mode whose layout claims exact parity."""
    parser = argparse.ArgumentParser(prog="python -m tools.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="config file(s), as for cli.py")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per mode (default 5)")
    parser.add_argument("--modes", default=",".join(parity_modes()), help="comma-separated strategy names")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, or 2 on CPU)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _check_modes(parser: argparse.ArgumentParser, modes: list[str]) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    unknown = [m for m in modes if m not in StrategyRegistry or layout_of(m).one_process]
    if unknown:
        known = {m for m in declared_modes() if not layout_of(m).one_process}
        parser.error(
            f"--modes: {', '.join(unknown)} cannot be compared here (dp joins by itself when 2+ GPUs exist). "
            f"Choose from: {', '.join(sorted(known))}"
        )


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    cli = parser()
    args = cli.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.worker:
        worker(args.worker)
        return None
    if args.steps < 1:
        cli.error("--steps must be at least 1")
    modes = [m for m in args.modes.split(",") if m]
    _check_modes(cli, modes)
    cuda = torch.cuda.device_count()
    nproc = args.nproc or (cuda if cuda >= 2 else 2)
    cli_args = [a for config in args.config for a in ("--config", config)] + extra
    scenario = {"name": "config", "args": cli_args, "modes": modes}
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        results = compare([scenario], args.steps, nproc, Path(tmp), "auto" if cuda >= 2 else "cpu")
    print(f"{args.steps} steps, {nproc} processes ({'cuda' if cuda >= 2 else 'cpu, gloo'}), dropout off")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
