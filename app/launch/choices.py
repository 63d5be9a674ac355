"""The plan's lines on how this run computes: the ``auto`` settings of a recipe resolved (:mod:`core.device`), the
compile cache, float32 matrix multiplications, where the data is decoded and normalised (the DataModule says), and
what a resume guarantees on CUDA; and the recipe's own choices: the weights' average, the weight decay's groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.launch.checks import data_class
from core.batch import torchvision_adjusted
from core.config import get
from core.device import AUTO, cuda_capability, describe, flag, on_cuda, precision_for, precision_reason
from core.layout import layout_of
from modules.classifier import COMPILE_CACHE


def data_lines(config: Any, cuda: bool) -> list[str]:
    """The DataModule's own plan lines (``core.datamodule.ImageData.plan_lines``), if it has any."""
    lines = getattr(data_class(config), "plan_lines", None)
    return list(lines(config.get("data").get("init_args") or {}, cuda)) if callable(lines) else []


def resume_line(deterministic: Any) -> str:
    """What a resumed run reproduces on CUDA, with and without ``--trainer.deterministic true``."""
    if deterministic is True:
        return (
            "resume       exact: deterministic kernels (trainer.deterministic true), trainer.benchmark off (the "
            "autotuner could pick other kernels after a resume), so a run stopped and resumed ends with the same "
            "weights as one never stopped"
        )
    return (
        "resume       the same samples, order and augmentations, but not bit for bit: cuDNN picks non-deterministic "
        "kernels, so two runs already differ; --trainer.deterministic true makes a resume exact (slower)"
    )


def lines(
    config: Any, accelerator: str, root_dir: str, startup_timeout: float | None, strategy: str = "auto"
) -> list[str]:
    """The plan's lines for this config on this accelerator: on CUDA every choice, elsewhere the settings a recipe
    left ``auto`` or turned on."""
    cuda = on_cuda(accelerator)
    trainer, out = config.trainer, []
    precision = trainer.get("precision")
    if precision == AUTO:
        capability = cuda_capability(cuda)  # bf16 where the GPU computes it (core.device.precision_for)
        note = precision_reason(capability) if capability else ""
        out.append(f"precision    {describe('trainer.precision', AUTO, precision_for(capability), cuda, note)}")
    channels_last = get(config, "model", "channels_last", default=False)
    if cuda or channels_last is True or channels_last == AUTO:  # on CUDA each choice is said, elsewhere what is on
        memory = "channels_last (NHWC)" if flag(channels_last, cuda) else "NCHW"
        out.append(f"memory       {describe('model.channels_last', channels_last, memory, cuda)}")
    compile_ = get(config, "model", "compile", default=False)
    runs_compiled = layout_of(strategy).runs_compiled_models  # dp's replicas and ddp_mp's stages say no
    compiled = flag(compile_, cuda and runs_compiled) if compile_ == AUTO else compile_ is True
    if cuda or compile_ is True or compile_ == AUTO:
        state = "on" if compiled else "off"
        if compile_ == AUTO and cuda and not compiled:
            state += f", {strategy} does not run compiled models"
        out.append(f"compile      {describe('model.compile', compile_, state, cuda)}")
    if compiled:
        allowance = (
            f"; a first compile runs inside the start-up allowance, {startup_timeout:g} s" if startup_timeout else ""
        )
        out.append(
            f"             caches in {Path(root_dir) / COMPILE_CACHE} (TORCHINDUCTOR_CACHE_DIR): a restart, a "
            f"requeue or the next run there compiles nothing again{allowance}"
        )
    matmul = get(config, "model", "float32_matmul_precision")
    if cuda and matmul:
        tf32 = " (TF32 tensor cores)" if matmul == "high" else ""
        out.append(f"fp32 matmul  {matmul}{tf32} (model.float32_matmul_precision)")
    out += data_lines(config, cuda)
    if cuda:
        out.append(resume_line(trainer.get("deterministic")))
    return out


def recipe_lines(config: Any, global_batch: int | None) -> list[str]:
    """The plan's lines for the weights' moving average (``--ema``) and the weight decay's groups, when they are on."""
    out = []
    decay, torchvision = get(config, "ema", "decay"), get(config, "ema", "torchvision_decay")
    every = get(config, "ema", "update_every_n_steps", default=1)
    uses = "validation, the best checkpoint and a test after fit use the average; checkpoints hold both (--ema.*)"
    if torchvision is not None:
        epochs = get(config, "trainer", "max_epochs", default=1)
        warmup = get(config, "model", "warmup_epochs", default=0)
        adjusted = f"{torchvision_adjusted(torchvision, global_batch, every, epochs):.6g} = " if global_batch else ""
        out.append(
            f"ema          decay {adjusted}torchvision's {torchvision:g} adjusted to global batch "
            f"{global_batch or '(known at start)'} x {every} step(s) per update / {epochs} epochs"
            + (f", restarted at each update of the {warmup:g} warm-up epochs" if warmup else "")
        )
        out.append(f"             {uses}")
    elif decay is not None:
        out += [f"ema          decay {decay:g} per update, every {every} step(s)", f"             {uses}"]
    given = get(config, "model", "optimizer", "weight_decay", default=0)
    groups = {"norm_weight_decay": "normalisation layers", "norm_bias_weight_decay": "normalisation layers and biases"}
    for key, which in groups.items():
        exempt = get(config, "model", key)
        if exempt is not None:
            out.append(f"weight decay {given:g}; {exempt:g} on {which} (model.{key})")
    return out
