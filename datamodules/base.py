"""What every image DataModule shares: one batch-size semantics and exact (unpadded) evaluation.

Batch semantics, stated once: ``batch_size`` is the number of images each process loads per step (per device under
``ddp``/``allreduce``; under ``dp`` the one process's batch is split across its GPUs). The global batch, the images
behind one optimizer step, is ``batch_size x world_size x accumulate_grad_batches``. Alternatively give
``global_batch_size``: ``setup()`` derives the per-device batch from it and refuses a global batch that does not split
evenly, naming every factor.

Exact evaluation: Lightning's injected ``DistributedSampler`` pads the validation set with duplicates so that every
rank gets the same number of images, which biases accuracy (pytorch/pytorch#25162). For validation, test and predict
loaders the DataModule uses Lightning's ``UnrepeatedDistributedSampler`` itself (Lightning then leaves it alone), so
every image is evaluated exactly once and the metric sums are exact.

The device stage (the part of timm's ``PrefetchLoader`` that runs on the device, for any data set): the batch-transfer
hooks decode a batch of encoded images on the device (:mod:`datamodules.gpu_decode`, when the loader hands over
bytes), normalise uint8 images there (``normalize_on_device``: the workers hand over 4x fewer bytes) and mix training
batches (``mixup_alpha``, ``cutmix_alpha``: :class:`~datamodules.augment.BatchMixer`). A DataModule turns each on by
its options; none needs hooks of its own.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import warnings
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from core.batch import BatchPlan, resolve_batch
from core.device import Auto, describe, flag
from core.env import Launch, detect
from core.layout import layout_of
from datamodules.augment import MEAN, MIXING_RANGES, STD, BatchMixer, mixing_lines, range_problems
from datamodules.gpu_decode import BatchDecoder, EncodedBatch, input_dtype, on_side_stream, open_decoder
from datamodules.resident import ResidentTensors, quiet_the_worker_hint, whole_batch
from datamodules.resumable import ResumableLoader, ResumableSampler, SeededDataset, ignore_sigint

Workers = int | Literal["auto"]  # --data.num_workers 4, or auto (see auto_workers)

# What a forkserver imports once, so that each loader worker forked from it starts in milliseconds: the datasets'
# modules and what unpickling them needs (without them every worker imports torch itself, seconds each)
FORKSERVER_PRELOAD = [
    "torch", "torchvision", "PIL.Image", "datamodules.imagenet", "datamodules.mnist", "datamodules.shards",
    "datamodules.forkserver_guard",  # the forkserver dies with the process that started it
]  # fmt: skip


def worker_context(world_size: int) -> Any:
    """How loader workers start: None (PyTorch's default, ``fork``) or the ``forkserver`` context.

    CPython before 3.12 (3.11.10 carries the backport) can leave a forked child waiting forever, inside ``os.fork``,
    on the interpreter's thread-state lock when another thread of the parent held it at that instant (gh-112275,
    ``_PyThreadState_DeleteExcept`` in ``PyOS_AfterFork_Child``). A process of a multi-process job always has other
    threads (gloo's or NCCL's, the hang watch, the logger's writer). On Python 3.11.7 a 2-process job of three fits
    with loader workers had a worker stuck that way in 2 of about 100 runs here, and once in CI (never seen with one
    process): its rank waited for the worker's first batch, the other rank's collective timed out, and the job ended
    as "lost rank". There the workers start from a forkserver instead: a process started by exec, with no thread of
    the job in it, forks each worker (the start method Python 3.14 makes the default). Single-process runs, and
    Python 3.12 and later, fork as PyTorch does. A forkserver worker cannot unpickle a dataset class defined in the
    ``__main__`` script: define it in a module.
    """
    if world_size < 2 or sys.version_info >= (3, 12) or sys.platform != "linux":
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts (once per process)
    return context


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which SLURM and containers narrow), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def node_cpus(processes_per_node: int, launch: Launch | None = None) -> int:
    """CPUs the training processes of this node share.

    torchrun and Lightning's own launcher start every process with the same affinity mask: that mask. SLURM with
    ``--cpus-per-task`` may bind each task to its own CPUs (task/affinity), so one task's mask is not the node's
    share: there it is ``--cpus-per-task`` x tasks (``launch``: default :func:`core.env.detect`).
    """
    launch = launch or detect()
    if launch.launcher == "slurm" and launch.cpus_per_task:
        return launch.cpus_per_task * processes_per_node
    return available_cpus()


def auto_workers(processes_per_node: int, cpus: int) -> int:
    """``--data.num_workers auto``: DataLoader workers per training process, ``cpus // processes_per_node - 1``.

    The rule of the classic ImageNet example, which divided the workers of a node by its processes
    (``workers // ngpus_per_node``), with the CPUs this job may use on the node (:func:`node_cpus`) and one CPU per
    process kept for the training loop itself (it collates, copies to the device and launches the kernels; a worker
    competing for its CPU stalls every step). 0 (load in the main process) when no CPU is left over.
    """
    return max(cpus // max(processes_per_node, 1) - 1, 0)


def workers_warning(num_workers: int, processes_per_node: int, cpus: int | None = None) -> str | None:
    """A warning when the DataLoader workers of all processes on this node outnumber its CPUs, else None."""
    cpus = cpus or available_cpus()
    total = num_workers * processes_per_node
    if total <= cpus:
        return None
    fit = auto_workers(processes_per_node, cpus)
    return (
        f"data.num_workers {num_workers} x {processes_per_node} process(es) on this node = {total} loader workers "
        f"for {cpus} CPUs: the workers compete for CPUs and the input pipeline slows down. "
        f"Use --data.num_workers {fit} or fewer, or auto (one CPU per process stays for the training loop)."
    )


@functools.cache
def _mean_std(
    device: torch.device, mean: tuple[float, ...] = MEAN, std: tuple[float, ...] = STD
) -> tuple[torch.Tensor, torch.Tensor]:
    # made once per device: building them from Python numbers is a blocking host-to-device copy on a GPU
    return torch.tensor(mean, device=device).view(-1, 1, 1) * 255, torch.tensor(std, device=device).view(-1, 1, 1) * 255


def normalize(images: torch.Tensor, mean: tuple[float, ...] = MEAN, std: tuple[float, ...] = STD) -> torch.Tensor:
    """uint8 images [N, C, H, W] (or [C, H, W]) with values 0..255 -> float32 normalised by the per-channel ``mean``
    and ``std`` of values 0..1 (ImageNet's by default)."""
    mean_levels, std_levels = _mean_std(images.device, mean, std)
    return (images.float() - mean_levels) / std_levels


class ImageDataModule(LightningDataModule):
    """Base of the app's DataModules (each meets :class:`core.datamodule.ImageData`): per-device batch semantics,
    ``global_batch_size``, exact evaluation.

    Subclasses build their datasets in ``setup()`` (calling ``super().setup(stage)`` first) and their loaders with
    :meth:`_loader`; the device stage (the batch-transfer hooks) is theirs by the options below.

    Args:
        batch_size: images per device and step (under ``dp``: per process, split across its GPUs).
        global_batch_size: if given, images per optimizer step over all processes; the per-device batch is derived
            from it in ``setup()`` and ``batch_size`` is ignored.
        num_workers: DataLoader worker processes per training process, or ``"auto"``: the node's CPUs divided by
            its training processes, less one each (:func:`auto_workers`), resolved in ``setup()`` and logged.
        normalize_on_device: the data set hands over uint8 images and the device stage normalises them by
            :attr:`mean` and :attr:`std` after the transfer (``auto``: on CUDA only); a uint8 batch is normalised
            there whatever this says.
        mixup_alpha: MixUp of each training batch with Beta(alpha, alpha) on the device (0: none); with
            ``cutmix_alpha`` too, one of the two per batch, at even odds. Each device's share of the batch is mixed
            within itself (:class:`~datamodules.augment.BatchMixer`); the labels become probabilities.
        cutmix_alpha: CutMix of each training batch with Beta(alpha, alpha) (0: none).
    """

    def __init__(
        self,
        batch_size: int,
        global_batch_size: int | None = None,
        num_workers: Workers = 0,
        normalize_on_device: bool | Auto = False,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"data.batch_size must be a positive number of images per device, got {batch_size}")
        if global_batch_size is not None and global_batch_size <= 0:
            raise ValueError(f"data.global_batch_size must be a positive number of images, got {global_batch_size}")
        if num_workers != "auto" and not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(
                f"data.num_workers must be 0 (load in the main process), more, or auto; got {num_workers!r}"
            )
        self.batch_size = batch_size
        self._batch_size_arg = batch_size
        self.requested_global_batch_size = global_batch_size
        self.requested_num_workers = num_workers
        self.num_workers = num_workers  # an int once setup() has resolved "auto"
        self.batch_plan: BatchPlan | None = None
        # the device stage: normalize_on_device as resolved in setup() (auto: on CUDA), the mixing, the GPU decoder
        self.requested_normalize_on_device = normalize_on_device
        self.normalizes_on_device = False
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mixer: BatchMixer | None = None  # made with the training loader (it needs the run's seed)
        self._batch_decoder: BatchDecoder | None = None  # made on the first encoded batch, on this rank's device
        self._decode_stream: Any = None  # the CUDA stream it decodes on, beside the training stream
        self.decode_threads = 1  # CPU threads the decoding may use in this process: set in setup()
        self.skipped: list[str] = []  # unreadable images left out of their batches

    # core.datamodule.ImageData's defaults; a subclass sets num_classes and in_channels, and overrides what differs
    input_shape: tuple[int, ...] | None = None
    random_transforms = False  # True where the training transforms draw random numbers (crops, flips)
    repeats = 1  # repeated augmentation: each sample of an epoch loaded this many times (datamodules.resumable)
    # tools.parity's single device replays the global batches of a run of this many ranks, each the concatenation of
    # the ranks' shards: what is drawn per device (the batch mixing) is drawn per shard, as each rank drew it
    replay_shards: int | None = None
    train_seed = 0  # the training sampler's seed (the run's), known once the training loader exists
    mean, std = MEAN, STD  # per channel, of values 0..1: what normalising on the device subtracts and divides by
    skip_unreadable = False  # the device stage's GPU decoder leaves unreadable images out instead of stopping
    decode_hardware_only = False  # data.decode auto: the GPU decodes only with a hardware JPEG decoder, else the CPU
    decoder_opener = staticmethod(open_decoder)  # makes nvImageCodec's decoder (BatchDecoder's opener)

    @classmethod
    def config_problems(cls, init_args: Any) -> list[str]:
        """This class's checks of its ``data.init_args`` before it is built (the preflight asks): here the mixing's
        alphas (none negative)."""
        return range_problems(MIXING_RANGES, init_args)

    @classmethod
    def plan_lines(cls, init_args: Any, cuda: bool) -> list[str]:
        """What the preflight plan says of this data before it is built (``cuda``: the run is on CUDA): here the
        device stage's normalising and mixing, each when it is on."""
        given = init_args.get("normalize_on_device", False)
        return ([cls.normalise_line(given, cuda)] if flag(given, cuda) else []) + mixing_lines(init_args)

    @staticmethod
    def normalise_line(given: bool | Auto, cuda: bool) -> str:
        """The plan's line for where the images are normalised (``data.normalize_on_device``)."""
        where = "on the device" if flag(given, cuda) else "in the loader workers"
        return f"normalise    {describe('data.normalize_on_device', given, where, cuda)}"

    @property
    def global_batch_size(self) -> int | None:
        """Images per optimizer step over all processes, known once ``setup()`` has run under a Trainer."""
        return self.batch_plan.global_batch if self.batch_plan else None

    def setup(self, stage: str | None = None) -> None:
        self.normalizes_on_device = flag(self.requested_normalize_on_device, self._device().type == "cuda")
        trainer = self.trainer
        # this node's training processes: LOCAL_WORLD_SIZE (torchrun), SLURM's tasks per node, or trainer.devices
        # (Lightning's own launcher), which the preflight checked agree; 1 under dp
        processes = max(trainer.world_size // max(trainer.num_nodes, 1), 1) if trainer is not None else 1
        cpus = node_cpus(processes)
        if self.requested_num_workers == "auto":
            self.num_workers = auto_workers(processes, cpus)
            rank_zero_info(
                f"data.num_workers auto: {self.num_workers} loader worker(s) per process ({cpus} CPUs on this node "
                f"// {processes} training process(es), minus 1 each for the training loop)"
            )
        # what the GPU decoder's threads may use: this process's share of the node, less its loader workers (0
        # would start one thread per core in every process)
        self.decode_threads = max(cpus // processes - self.num_workers, 1)
        if trainer is None:
            return
        self.batch_plan = resolve_batch(
            self._batch_size_arg,
            self.requested_global_batch_size,
            trainer.world_size,
            trainer.accumulate_grad_batches,
            trainer.num_nodes,
        )
        self.batch_size = self.batch_plan.per_device
        if self.requested_global_batch_size is not None:
            rank_zero_info(f"data.global_batch_size {self.requested_global_batch_size}: {self.batch_plan.describe()}")
        warning = workers_warning(self.num_workers, processes, cpus)
        if warning:
            rank_zero_warn(warning)

    def _eval_sampler(self, dataset: Dataset) -> UnrepeatedDistributedSampler | None:
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not kwargs or kwargs.get("num_replicas", 1) <= 1:
            return None
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        return UnrepeatedDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)

    def _batches_done(self) -> int:
        """Batches of the current epoch the training loop has completed (non-zero when resuming mid-epoch).

        Also gives the training loader the checkpoint's loader state if Lightning has not: it does so only when its
        fit loop first builds the loader, and a ``configure_optimizers`` that reads ``estimated_stepping_batches``
        builds it before the checkpoint is restored, so the state would never arrive. This is Lightning's own
        loading routine, called once the state is there (it is a no-op when already done).
        """
        trainer = self.trainer
        if trainer is None or not trainer.training:
            return 0
        trainer.fit_loop._load_combined_loader_states()
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def batch_shards(self) -> tuple[int, int]:
        """Where this process's training batch lies in the step's global batch, in device shards: (first, count).
        ``ddp``: shard ``rank`` of one; a strategy that splits a process's batch over its devices (``dp``) says into
        how many (its layout's ``batch_splits``); :attr:`replay_shards`: all of them."""
        if self.replay_shards:
            return 0, self.replay_shards
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        splits = layout_of(trainer.strategy).batch_splits(trainer.strategy.root_device.type)
        return trainer.global_rank * splits, splits

    def _loader(self, dataset: Dataset, train: bool, **kwargs: Any) -> DataLoader:
        """A loader with the per-device batch; evaluation loaders get the unpadded sampler when distributed.

        The training loader is a :class:`~datamodules.resumable.ResumableLoader`: its shuffling sampler is a
        ``DistributedSampler`` for every layout (Lightning injects no other and calls ``set_epoch`` every epoch), and
        its position is saved in checkpoints, so a run stopped mid-epoch resumes with the very next batch. Subclasses
        whose training transforms draw random numbers set ``random_transforms``: each sample is then loaded with the
        generators seeded from (seed, epoch, sample), so a resumed run draws the same crops and flips.
        """
        resident = isinstance(dataset, ResidentTensors)  # held on the device: one indexing per batch, no workers
        if resident:
            kwargs = dict(collate_fn=whole_batch, **kwargs)
            quiet_the_worker_hint()
        workers = 0 if resident else self.num_workers
        common = dict(
            batch_size=self.batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available() and not resident,
            worker_init_fn=ignore_sigint if workers > 0 else None,  # Ctrl-C: the workers stay (resumable.py)
            multiprocessing_context=worker_context(self.trainer.world_size if self.trainer else 1)
            if workers > 0
            else None,
            **kwargs,
        )
        if not train:
            return DataLoader(dataset, shuffle=False, sampler=self._eval_sampler(dataset), **common)
        dist_kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        replicas, rank = (dist_kwargs["num_replicas"], dist_kwargs["rank"]) if dist_kwargs else (1, 0)
        sampler = ResumableSampler(dataset, num_replicas=replicas, rank=rank, repeats=self.repeats)
        self.train_seed = sampler.seed
        if self.random_transforms or self.repeats > 1:
            dataset = SeededDataset(dataset, sampler.seed, self.repeats)
        loader = ResumableLoader(dataset, sampler, progress=self._batches_done, **common)
        if self.mixup_alpha or self.cutmix_alpha:
            self.mixer = BatchMixer(self.num_classes, self.mixup_alpha, self.cutmix_alpha, self.train_seed)
        return loader

    # ------------------------------------------------------------------------------------------------ the device stage
    def _device(self) -> torch.device:
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def _input_dtype(self) -> torch.dtype:
        return input_dtype(str(self.trainer.precision) if self.trainer is not None else "32-true")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, EncodedBatch):
            return batch
        device = self._device()
        if self._batch_decoder is None:  # made on first use, on this rank's device (Lightning has set it by now)
            self._batch_decoder = BatchDecoder(
                device, self.skip_unreadable, self.decode_threads, self.decode_hardware_only, self.decoder_opener
            )
        decode = functools.partial(self._batch_decoder, batch, self._input_dtype())
        if device.type == "cuda":
            if self._decode_stream is None:  # waits once for the decoder's constants, made on the training stream
                self._decode_stream = torch.cuda.Stream(device)
                self._decode_stream.wait_stream(torch.cuda.current_stream(device))
            images, labels = on_side_stream(decode, self._decode_stream, torch.cuda.current_stream(device), torch.cuda)
        else:
            images, labels = decode()
        return (images, labels, batch.skipped) if batch.skipped else (images, labels)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, torch.Tensor):  # the model summary's example input: float images, no labels
            return batch
        images, labels, *rest = batch
        if rest:
            self._note_skipped(rest[0])
        if images.dtype == torch.uint8:
            # Lightning casts a batch to the precision's input dtype before this hook, when it is still uint8: the
            # normalised images are made in it here, as the GPU decoder makes them (bf16 for bf16-mixed: every input
            # path hands the step the same dtype, so a compiled step has one graph)
            images = normalize(images, self.mean, self.std).to(self._input_dtype())
        if self.mixer is not None and self.trainer is not None and self.trainer.training:
            # the batch's position: the epoch and this batch's index in it (the training loop counts it ready after
            # this hook), restored with the loop on a resume
            epoch, batch_index = (
                self.trainer.current_epoch,
                self.trainer.fit_loop.epoch_loop.batch_progress.current.ready,
            )
            images, labels = self.mixer(images, labels, epoch, batch_index, *self.batch_shards())
        return images, labels

    def _note_skipped(self, paths: list[str]) -> None:
        if paths and not self.skipped:
            warnings.warn(f"skipping unreadable image {paths[0]} (--data.skip_unreadable true)", stacklevel=2)
        self.skipped.extend(paths)

    def teardown(self, stage: str) -> None:
        decoded = self._batch_decoder
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if decoded is not None:
            self.skipped += decoded.skipped
            if decoded.fallbacks:
                warnings.warn(
                    f"rank {rank}: {len(decoded.fallbacks)} image(s) nvImageCodec could not decode were decoded on the "
                    f"CPU instead, e.g. {decoded.fallbacks[0]}",
                    stacklevel=2,
                )
            decoded.skipped, decoded.fallbacks = [], []
        if self.skipped:
            stage = getattr(stage, "value", stage)  # the Trainer passes its TrainerFn enum
            warnings.warn(
                f"rank {rank}: skipped {len(self.skipped)} unreadable image(s) during {stage}, e.g. {self.skipped[0]}",
                stacklevel=2,
            )
            self.skipped = []
