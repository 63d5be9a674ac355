"""``dp``: one process drives every selected GPU through ``torch.nn.DataParallel`` (removed from Lightning in 2.0).

Each DataLoader batch is split across the GPUs (``data.batch_size`` is the global batch), the replicas' outputs are
gathered on the first GPU, reduced there and logged once. Without CUDA it runs as a single device, with a warning.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from core.env import detect
from core.errors import UserError
from core.layout import Layout

# LightningModule step -> stage name given to ``log_step`` (the protocol of modules.ImageClassifier)
_STAGES = {"training_step": "train", "validation_step": "val", "test_step": "test"}
CHANNELS_LAST = torch.channels_last


def _splits_steps(module: nn.Module, step: str) -> bool:
    """Whether ``step`` runs as ``forward_step`` in the replicas + ``log_step`` once on the root device."""
    return step in _STAGES and hasattr(module, "forward_step") and hasattr(module, "log_step")


class StepDispatcher(nn.Module):
    """What DataParallel replicates: ``forward(step_name, ...)`` runs that step of the LightningModule.

    Lightning's ``_ForwardRedirection`` cannot be used: it patches ``forward`` on the module instance, and the
    replicas DataParallel makes are shallow copies whose patched closure would call the master module.
    """

    def __init__(self, module: nn.Module, forward_context: Any) -> None:
        super().__init__()
        self.module = module
        self._forward_context = forward_context

    def forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        # autocast is thread-local and DataParallel runs the replicas in threads: open it inside each replica
        with self._forward_context():
            if _splits_steps(self.module, step):
                out = self.module.forward_step(*args[:1], **kwargs)
                # filled on the device: new_tensor([n]) would be a blocking host-to-device copy in every replica
                batch_size = torch.full((1,), out["target"].shape[0], dtype=torch.float32, device=out["target"].device)
                return {**out, "loss": out["loss"].reshape(1), "batch_size": batch_size}
            out = getattr(self.module, step)(*args, **kwargs)
            # gather concatenates along dim 0: give scalars a dimension, so the gathered loss is a vector
            return out.reshape(1) if isinstance(out, Tensor) and out.dim() == 0 else out


COMPILE_REFUSED = (
    "dp cannot run a compiled model (model.compile): nn.Module.compile() binds the compiled forward to the module it "
    "was called on, and DataParallel's replicas copy that binding, so every GPU would run the first GPU's weights. "
    "Fix: --trainer.strategy ddp (one process per GPU, compile works there), or --model.compile false."
)


class _DataParallel(nn.DataParallel):
    """DataParallel whose replicas keep the master's memory format (channels_last weights stay channels_last)."""

    def replicate(self, module: nn.Module, device_ids: Any) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        # the broadcast hands the replicas contiguous (NCHW) copies; NHWC inputs would then make cuDNN convert
        # every weight in every step, on every GPU but the first
        for replica in replicas:
            for master, copy in zip(module.modules(), replica.modules(), strict=True):
                for name, param in master._parameters.items():
                    if param is not None and param.dim() == 4 and param.is_contiguous(memory_format=CHANNELS_LAST):
                        setattr(copy, name, getattr(copy, name).contiguous(memory_format=CHANNELS_LAST))
        return replicas


class DataParallelStrategy(ParallelStrategy):
    """``torch.nn.DataParallel`` for the Lightning 2.x Trainer: fit, validate, test and predict.

    Modules with ``forward_step(batch) -> {"loss", "logits", "target"}`` and ``log_step(outputs, stage)`` get the
    forward and loss computed in the replicas and the metrics computed and logged once on the root device, from the
    gathered outputs and the batch-size-weighted mean of the replicas' losses (their ``*_step`` methods are not called
    for train/val/test). Other modules run their ``*_step`` in the replicas (do not call ``self.log`` there) and the
    training loss is the mean over replicas.
    """

    strategy_name = "dp"

    def _refuse_multi_process(self) -> None:
        # the preflight refuses this before anything starts; here for a launch it could not see (the step's tasks of
        # srun, set by srun only: a batch script running plain `python` is one process) and for Lightning scripts
        launch = detect()
        world = max(launch.world_size_var or 1, launch.step_tasks or 1)
        if world > 1:
            raise UserError(
                f"dp is single-process, but this run was launched as {world} processes (torchrun WORLD_SIZE or srun "
                "--ntasks). Fix: --trainer.strategy ddp for one process per GPU, or launch dp as one task "
                "(srun --ntasks=1 / plain python) that sees all its GPUs.",
                help="dp-one-process",
            )

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    # One process: whatever cluster environment the Trainer attached, the ranks are 0 and the world is 1.
    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False  # no DistributedSampler: DataParallel splits each batch itself

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None

    @override
    def setup_environment(self) -> None:
        self._refuse_multi_process()
        super().setup_environment()
        n, cuda = len(self.parallel_devices or []), self.root_device.type == "cuda"
        if not cuda:
            rank_zero_warn("dp: no CUDA device selected, so dp runs as a single device on the CPU (no replicas).")
        rank_zero_info(
            f"dp: one process drives {n if cuda else 1} device(s) "
            f"{[str(d) for d in self.parallel_devices or []] if cuda else ['cpu']}; "
            "each DataLoader batch is split across them (data.batch_size is the global batch, unlike ddp where it "
            "is per device). Replicas are re-copied every step; ddp is usually faster."
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        dispatcher = StepDispatcher(model, self.precision_plugin.forward_context)
        if self.root_device.type != "cuda":
            return dispatcher  # same code path, no replicas
        if len(self.parallel_devices) > 1 and any(m._compiled_call_impl is not None for m in model.modules()):
            raise UserError(COMPILE_REFUSED, help="preflight")  # the preflight's problem, when it did not run
        return _DataParallel(dispatcher, device_ids=[d.index for d in self.parallel_devices])

    def _run(self, step: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        out = self.model(step, *args, **kwargs)
        if _splits_steps(self.lightning_module, step):
            sizes = out.pop("batch_size")
            out["loss"] = (out["loss"] * sizes).sum() / sizes.sum()  # equals the loss over the whole batch
            return self.lightning_module.log_step(out, _STAGES[step])
        if step == "training_step":
            if isinstance(out, dict):
                return {**out, "loss": out["loss"].mean()}
            return out.mean() if isinstance(out, Tensor) else out
        return out

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._run("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run("predict_step", *args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor  # one process: nothing to reduce across

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @override
    def teardown(self) -> None:
        self.model = self.lightning_module  # unwrap
        super().teardown()

    @classmethod
    def layout(cls, devices: int | None, num_nodes: int = 1, **init_args: Any) -> Layout:
        """One process drives every device of its node and splits each batch over them (what a DataModule draws per
        device, the batch mixing, it draws per split, as ddp's ranks do); compile auto stays off: its replicas would
        run the first GPU's weights."""
        return Layout(
            processes_per_node=1, devices_per_process=devices or 1, one_process=True, splits_batch=True,
            runs_compiled_models=False,
        )  # fmt: skip

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "dp", cls, description="torch.nn.DataParallel: one process, the batch split over GPUs", override=True
        )
