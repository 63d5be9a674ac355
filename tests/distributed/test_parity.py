"""Every mode trains the same model: 2 gloo processes vs one device that sees each whole global batch in rank order.

After 6 SGD-with-momentum steps (crossing an epoch boundary), fp32, tolerance 1e-5; with SyncBatchNorm, 5 steps. The
modern ImageNet recipe on real photos: each rank mixes its own share of the global batch (mixup/cutmix drawn from the
batch's position and the rank), and the one device replays the global batch as the ranks' shards, mixing each as its
rank did: every mode ends with the one device's moving average and training weights.
"""

from pathlib import Path

import pytest
import torch

from bench.parity_report import SYNCBN_STEPS
from modules import ImageClassifier
from tests.distributed.conftest import AMP_MODES, EXACT_MODES, MODERN_MODES, STEPS

TOL = 1e-5
# one torchrun job of every mode and scenario, shared with the other modules of the "parity" group
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("parity")]


@pytest.mark.parametrize("scenario", ["plain", "accumulate"])
@pytest.mark.parametrize("mode", EXACT_MODES)
def test_mode_matches_single_device(parity, scenario, mode):
    facts = parity["scenarios"][scenario]["modes"][mode]
    assert facts["steps"] == STEPS
    assert facts["max_diff_vs_single"] < TOL, f"{mode} ({scenario}) drifted from single device: {facts}"
    assert facts["ranks_identical"], f"{mode} ({scenario}): the ranks hold different parameters"


def test_the_comparison_is_not_vacuous(parity):
    """Training moved the weights far beyond the tolerance, and BatchNorm's per-rank statistics are visible."""
    for scenario in ("plain", "accumulate", "batchnorm"):
        assert parity["scenarios"][scenario]["modes"]["ddp"]["moved"] > 100 * TOL
    assert parity["scenarios"]["batchnorm"]["modes"]["ddp"]["max_diff_vs_single"] > 10 * TOL


@pytest.mark.parametrize("mode", [m for m in EXACT_MODES if m != "ddp"])
def test_batchnorm_modes_match_ddp(parity, mode):
    facts = parity["scenarios"]["batchnorm"]["modes"][mode]
    assert facts["max_diff_vs_ddp"] < TOL, f"{mode} with BatchNorm drifted from ddp: {facts}"
    assert facts["ranks_identical"]


def test_allreduce_makes_batchnorm_buffers_equal_across_ranks(parity):
    for mode in ("allreduce", "allreduce_per_param", "allreduce_overlap"):
        assert parity["scenarios"]["batchnorm"]["modes"][mode]["buffers_identical"], mode


def test_fp16_wire_compression_stays_close(parity):
    facts = parity["scenarios"]["plain"]["modes"]["allreduce_fp16"]
    assert facts["ranks_identical"]
    assert facts["max_diff_vs_single"] < 1e-3  # half-precision gradients: close, not exact
    assert facts["max_diff_vs_single"] > 0  # and the compression really happened


@pytest.mark.parametrize("scenario", ["plain", "batchnorm"])
def test_shards_are_disjoint_and_change_with_the_epoch(parity, scenario):
    sampler = parity["scenarios"][scenario]["sampler"]
    assert sampler["distributed_sampler"], "Lightning did not inject its DistributedSampler"
    assert sampler["disjoint"] and sampler["epochs_differ"]
    assert sampler["last_epoch_seen"] == 1, "Lightning did not call set_epoch when the second epoch began"


def test_compiled_ddp_and_allreduce_match_the_eager_single_device(parity):
    """torch.compile (Inductor on the CPU) under ddp and allreduce: the same weights as the eager model on one
    device, to the fp32 tolerance; the first mode compiled its graph, the second ran it again."""
    modes = parity["scenarios"]["compiled"]["modes"]
    assert set(modes) == {"ddp", "allreduce"} and sum(m["compiled_graphs"] for m in modes.values()) > 0, modes
    for mode, facts in modes.items():
        assert facts["max_diff_vs_single"] < TOL and facts["ranks_identical"] and facts["moved"] > 100 * TOL, mode


def test_a_compiled_models_checkpoint_loads_into_an_eager_model_and_back(parity):
    """The compiled allreduce run's checkpoint: the network's own parameter names (no ``_orig_mod.``), loaded
    strictly into an eager model, which holds the compiled run's weights, whose state loads into a compiled one."""
    facts = parity["scenarios"]["compiled"]["modes"]["allreduce"]
    state = torch.load(facts["checkpoint"], weights_only=True)["state_dict"]
    assert state and not [k for k in state if "_orig_mod" in k], list(state)[:5]
    eager = ImageClassifier(arch="mnist_cnn")
    eager.load_state_dict(state)
    trained = torch.load(Path(facts["checkpoint"]).with_suffix(".pt"), weights_only=True)
    assert torch.equal(torch.cat([p.detach().double().reshape(-1) for p in eager.parameters()]), trained)
    compiled = ImageClassifier(arch="mnist_cnn", compile=True)
    compiled.load_state_dict(eager.state_dict())
    assert compiled.net._compiled_call_impl is not None and list(compiled.state_dict()) == list(state)


@pytest.mark.parametrize("mode", AMP_MODES)
def test_fp16_overflow_on_one_rank_is_skipped_by_every_rank(parity, mode):
    """Gradients are averaged before the GradScaler unscales them, so rank 1's inf reaches rank 0 and both skip."""
    facts = parity["scenarios"]["amp"]["modes"][mode]
    assert facts["loss_scale_same_on_ranks"] and facts["ranks_identical"], facts
    # one overflow: the initial scale 2^16 halved once (it grows back only after 2000 good steps); the README's figure
    assert facts["loss_scale"] == 32768.0, facts
    assert facts["steps"] == STEPS


@pytest.mark.parametrize("mode", [m for m in AMP_MODES if m != "ddp"])
def test_fp16_overflow_skips_leave_the_same_weights_as_ddp(parity, mode):
    assert parity["scenarios"]["amp"]["modes"][mode]["max_diff_vs_ddp"] < TOL


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_sync_batchnorm_matches_single_device(parity, mode):
    """What SyncBatchNorm is for: the default BatchNorm network on 2 x 8 images trains as one device on 16 (float64,
    see bench.parity_report.FP64), in ddp and in the modes without the DDP wrapper or split over stages."""
    facts = parity["scenarios"]["syncbn"]["modes"][mode]
    assert facts["steps"] == SYNCBN_STEPS and facts["ranks_identical"], facts
    assert facts["max_diff_vs_single"] < TOL, f"{mode} with SyncBatchNorm drifted from single device: {facts}"


def test_without_sync_batchnorm_the_same_run_does_not_match(parity):
    plain = parity["scenarios"]["syncbn_off"]["modes"]["ddp"]
    assert plain["steps"] == SYNCBN_STEPS and plain["max_diff_vs_single"] > 1000 * TOL, plain
    assert parity["scenarios"]["syncbn"]["modes"]["ddp"]["moved"] > 1000 * TOL


def test_sync_batchnorm_in_fp32_stays_close(parity):
    """fp32 (the default precision): rounding differences grow in this run, but stay far below per-rank statistics."""
    synced = parity["scenarios"]["syncbn_fp32"]["modes"]["ddp"]
    assert synced["ranks_identical"]
    assert synced["max_diff_vs_single"] * 10 < parity["scenarios"]["syncbn_off"]["modes"]["ddp"]["max_diff_vs_single"]


def test_allreduce_with_sync_batchnorm_keeps_buffers_equal(parity):
    for mode in ("allreduce", "allreduce_per_param", "allreduce_overlap"):
        assert parity["scenarios"]["syncbn"]["modes"][mode]["buffers_identical"], mode


def test_the_table_says_why_batchnorm_differs_from_single_device(parity):
    """The 'vs single' column of a BatchNorm network is not 0 by design; the printed table says so, and which column
    to read, for those scenarios only; with SyncBatchNorm it says to read 'vs single'."""
    from tools.parity import table

    assert parity["scenarios"]["batchnorm"]["batchnorm"] and not parity["scenarios"]["plain"]["batchnorm"]
    printed = table(parity)
    for name, out in parity["scenarios"].items():
        section = printed.split(f"[{name}]")[1].split("\n[")[0]
        per_rank = out["batchnorm"] and not out["sync_batchnorm"]
        assert ("This network has BatchNorm" in section and "Read 'vs ddp'" in section) == per_rank, name
        assert ("SyncBatchNorm" in section and "'vs single' is the column to read" in section) == out["sync_batchnorm"]


@pytest.mark.parametrize("mode", MODERN_MODES)
def test_the_modern_recipe_matches_single_device_on_the_average_and_the_training_weights(parity, mode):
    """configs/imagenet_modern.yaml (resnet18 at 32 px, repeated augmentation x4, TrivialAugment, random erasing,
    mixup/cutmix, no decay on norm layers, a warm-up epoch, the moving average every step) in float64 with
    SyncBatchNorm: 'vs single' is the average (what the run ends with), then its training weights. The average is
    stored in float32 (the module's dtype when Lightning's averaging callback copies it), hence 1e-7, not 1e-13."""
    facts = parity["scenarios"]["modern"]["modes"][mode]
    assert facts["steps"] == STEPS and facts["ranks_identical"], facts
    assert facts["max_diff_vs_single"] < TOL and facts["training_max_diff_vs_single"] < TOL, facts


def test_the_modern_recipes_comparison_is_not_vacuous(parity):
    """The weights moved far beyond the tolerance, the average is far from the training weights, and the sampler
    repeated each sample over disjoint positions that change with the epoch."""
    modern = parity["scenarios"]["modern"]
    facts = modern["modes"]["ddp"]
    assert facts["moved"] > 100 * TOL and facts["average_vs_training"] > 100 * TOL, facts
    sampler = modern["sampler"]
    assert sampler["repeats"] == 4 and sampler["disjoint"] and sampler["epochs_differ"], sampler
