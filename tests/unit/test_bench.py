"""The benchmarks' code paths with tiny settings: the files a user reads exist and hold sane numbers.

Timings are never asserted (they belong in bench/results); the step-time and all-reduce benchmarks share one
2-process gloo job, so the process start-up is paid once.
"""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest

from bench import comm, gpu, step_time
from bench.common import run_job


def _finite_positive(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _valid_png(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0, f"{path} is blank"


@pytest.fixture(scope="module")
def bench_job(tmp_path_factory):
    """One gloo job: every step-time mode for 3 steps of the MNIST CNN, and all-reduces of three sizes."""
    work = tmp_path_factory.mktemp("bench")
    out = work / "results"
    settings = {"steps": 3, "rounds": 1, "warmup": 0, "batch_size": 4, "image_size": 32, "accelerator": "cpu",
                "world_size": 2, "command": "test"}  # fmt: skip
    sizes = [4096, 65536, 2**20]
    tasks = [
        step_time.task(["cnn"], ["32-true"], list(step_time.MODES), settings, str(work)),
        comm.task(sizes, 1, 2, 1),
    ]
    raw = run_job(tasks, nproc=2, workdir=work)
    timing = step_time.report(raw["step_time"], settings, [0.0, 0.0], out)
    comm_settings = {"backend": "gloo", "world_size": 2, "rounds": 1, "iters": 2, "warmup": 1, "command": "test"}
    bandwidth = comm.report(raw["comm"], comm_settings, [0.0, 0.0], out)
    return {"out": out, "timing": timing, "bandwidth": bandwidth, "sizes": sizes}


@pytest.mark.distributed
@pytest.mark.slow
def test_step_time_has_every_mode_with_sane_ratios(bench_job):
    out = bench_job["out"]
    saved = json.loads((out / "step_time.json").read_text())
    assert saved == json.loads(json.dumps(bench_job["timing"]))
    assert {"date", "host_cpus", "torch", "lightning"} <= set(saved["machine"])
    modes = saved["groups"]["cnn 32-true"]
    assert set(modes) == set(step_time.MODES)
    for mode, stats in modes.items():
        assert stats["n"] >= 1, mode
        assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"], mode
        assert _finite_positive(stats["img_per_s"]), mode
        assert stats["world_size"] == (1 if step_time.MODES[mode][0] == 1 else 2)
        assert set(stats["ratio"]) == set(step_time.MODES[mode][1]), mode  # every counterpart measured
        for other, ratio in stats["ratio"].items():  # median of per-round ratios: one round here, so equal
            assert _finite_positive(ratio), (mode, other)
            assert ratio == pytest.approx(stats["median_ms"] / modes[other]["median_ms"])
            assert stats["ratio_of_medians"][other] == pytest.approx(ratio)
    table = (out / "step_time.md").read_text()
    for mode in modes:
        assert f"| {mode} |" in table
    assert "x plain_ddp" in table and "x plain_single" in table and "x plain_tutorial" in table
    for name in ("step_time_modes.png", "step_time_scaling.png"):
        _valid_png(out / name)


@pytest.mark.distributed
@pytest.mark.slow
def test_comm_bandwidths_follow_the_nccl_tests_convention(bench_job):
    out = bench_job["out"]
    saved = json.loads((out / "comm_gloo.json").read_text())
    rows = saved["rows"]
    assert [r["bytes"] for r in rows] == bench_job["sizes"]
    for row in rows:
        assert _finite_positive(row["median_ms"])
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["median_ms"] / 1e3) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert "| 1 MiB |" in (out / "comm_gloo.md").read_text()
    _valid_png(out / "comm_gloo.png")


def test_ratio_pairs_the_modes_round_by_round():
    """The machine slows down 3x in the second round: the per-round ratio still shows the 10% overhead."""
    rounds = {m: [[0.100, 0.100], [0.300, 0.300]] for m in step_time.MODES}
    rounds["app_single"] = [[0.110, 0.110], [0.330, 0.330]]
    modes = step_time.analyse({"cnn 32-true": rounds}, batch_size=16, world=2)["cnn 32-true"]
    assert modes["app_single"]["ratio"]["plain_single"] == pytest.approx(1.10)
    assert modes["app_single"]["img_per_s"] == pytest.approx(16 / modes["app_single"]["median_ms"] * 1e3)
    assert modes["app_ddp"]["images_per_step"] == 32 and modes["app_single"]["images_per_step"] == 16


def test_bus_factor_and_sizes():
    assert comm.bus_factor(2) == 1.0
    assert comm.bus_factor(8) == pytest.approx(1.75)
    assert [comm.parse_size(s) for s in ("4K", "1M", "64MB", "4096")] == [4096, 2**20, 64 * 2**20, 4096]
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        comm.parse_size("3")


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (step_time.main, ["--models", "vgg"], "--models: unknown vgg; choose from cnn, resnet18"),
        (step_time.main, ["--precisions", "16-mixed"], "16-mixed runs on GPUs only"),
        (comm.main, ["--sizes", "4K,3"], "--sizes: message size '3'"),
        (gpu.main, ["--smoke", "--configs", "bf17"], "--configs: unknown bf17; choose from bf16 channels_last"),
    ],
)
def test_bad_arguments_name_the_fix(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_mfu_uses_the_forward_and_backward_flop_and_the_precision_peak():
    assert gpu.peak_flops("NVIDIA H200", "bf16-mixed", True) == 989e12
    assert gpu.peak_flops("NVIDIA H200", "32-true", True) == 494.5e12
    assert gpu.peak_flops("NVIDIA H200", "32-true", False) == 67e12
    assert gpu.peak_flops("Some GPU", "bf16-mixed", True) is None
    assert gpu.mfu(3079, "resnet50", 224, 989e12) == pytest.approx(3079 * 24.7e9 / 989e12)
    assert gpu.mfu(3079, "resnet50", 112, 989e12) == pytest.approx(3079 * 24.7e9 / 4 / 989e12)
    assert gpu.mfu(3079, "vit_b_16", 224, 989e12) is None


@pytest.mark.slow
def test_gpu_script_smoke_on_cpu(tmp_path, capsys):
    # one config keeps CI short; the others differ only in the precision string and memory format given to the app
    configs = ["tf32 channels_last"]
    results = gpu.main(["--smoke", "--skip-mnist", "--configs", ",".join(configs), "--out", str(tmp_path)])
    written = list(tmp_path.glob("gpu_*_smoke.json"))
    assert len(written) == 1 and written[0].with_suffix(".md").exists()
    saved = json.loads(written[0].read_text())
    assert [r["config"] for r in saved["throughput"]] == configs
    for row in saved["throughput"]:
        assert _finite_positive(row["img_per_s"]) and row["mfu"] is None  # no peak known for a CPU
        # the flag tells the truth about the recorded loss, and the table shows it (16 px, batch 2: the smoke's
        # ResNet-50 may well diverge; what matters is that a non-finite loss is flagged, never shown as a number)
        loss = row["last_loss"]
        assert isinstance(loss, float) and row["loss_finite"] is math.isfinite(loss), row
        shown = f"{loss:.3f}" if math.isfinite(loss) else f"{loss} (NOT FINITE: steps may be skipped)"
        assert f"| {shown} |" in written[0].with_suffix(".md").read_text()
    assert results["settings"]["smoke"] is True
    assert "| tf32 channels_last |" in written[0].with_suffix(".md").read_text()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_script_without_cuda_points_to_smoke(capsys):
    with pytest.raises(SystemExit):
        gpu.main([])
    assert "--smoke" in capsys.readouterr().err


@pytest.mark.slow
def test_mnist_time_to_accuracy_smoke(mnist_dir, tmp_path):
    """``python -m bench.mnist_time_to_accuracy --smoke``: both recipes, one epoch of 5 batches, the files written."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    command = [sys.executable, "-m", "bench.mnist_time_to_accuracy", "--smoke", "--out", str(tmp_path)]
    command += ["--data-dir", str(mnist_dir)]
    job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
    saved = json.loads((tmp_path / "mnist_time_to_accuracy.json").read_text())
    assert saved["settings"]["smoke"] is True and saved["settings"]["target"] == 99.0
    images = {"app": 5 * 256, "pytorch_example": 5 * 64}  # 5 batches of each recipe's batch size
    assert set(saved["runs"]) == set(images)
    for name, run in saved["runs"].items():
        (epoch,) = run["epochs"]  # one epoch each
        assert epoch["epoch"] == 1 and 10 < epoch["test_acc"] < 99, (name, epoch)  # learning, far from the target
        assert epoch["images_per_s"] * epoch["train_wall_s"] == pytest.approx(images[name]), (name, epoch)
        assert 0 < epoch["train_wall_s"] <= epoch["wall_with_test_eval_s"] <= run["fit_wall_s"]
    table = (tmp_path / "mnist_time_to_accuracy.md").read_text()
    assert table.startswith("# MNIST time to 99.0% test accuracy (SMOKE: 5 batches per run)")
    assert "| app | configs/mnist.yaml: mnist_lenet, Adam, batch 256, 1 epochs" in table
    assert "| pytorch_example | pytorch/examples mnist" in table and table.count("| not in 1 | - | - |") == 2
    _valid_png(tmp_path / "mnist_time_to_accuracy.png")


def test_step_profile_smoke(tmp_path):
    """Its code path at tiny settings: the three wall times, every profile row, the results files."""
    from bench import step_profile

    results = step_profile.main(["--steps", "6", "--rounds", "1", "--out", str(tmp_path)])
    wall = results["wall"]
    assert all(wall[k] > 0 for k in ("plain_ms", "lightning_ms", "app_ms", "ratio", "app_over_lightning"))
    # each timing from the loop it names: the plain loop without a Trainer, Lightning alone without callbacks, the
    # app with the default config's per-step callbacks, both Trainers through all 7 batches
    ran = results["ran"]
    assert ran["plain"] == {"trainer_steps": None, "callbacks": []}
    assert ran["lightning"] == {"trainer_steps": 7, "callbacks": []}
    assert ran["app"]["trainer_steps"] == 7 and {"AMPHealth", "SIGTERMCheckpoint"} <= set(ran["app"]["callbacks"])
    app_rows = results["profile"]["app"]
    assert {"forward (model)", "backward", "self.log (Lightning's bookkeeping)", "callback amp"} <= set(app_rows)
    assert app_rows["total"] > app_rows["forward (model)"] > 0
    written = json.loads((tmp_path / "step_profile.json").read_text())
    assert written["wall"] == pytest.approx(wall) and (tmp_path / "step_profile.md").read_text().startswith("# Where")


def test_gpu_check_steps_keep_the_inherited_pythonpath(monkeypatch, tmp_path):
    """On the GPU image jsonargparse lives only in .gpu-site, on the PYTHONPATH `make gpu-check` sets: the no-sync
    step's own PYTHONPATH replaced it and the app failed on import."""
    from bench.common import ROOT
    from bench.gpu_check import _subprocess_step

    site = tmp_path / ".gpu-site"
    (site / "only_in_gpu_site").mkdir(parents=True)
    (site / "only_in_gpu_site" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    code = "import only_in_gpu_site, bench.gpu_check; print('imported both')"
    row = _subprocess_step("imports", [sys.executable, "-c", code], 60, {"PYTHONPATH": str(ROOT)})
    assert row["status"] == "passed" and "imported both" in row["output"], row


def test_gpu_check_calls_fit_the_devices_300_s_with_margin_and_a_box_kills_its_whole_group():
    """Each call's install, start and boxes add up to at most 270 of the 300 s the device gives a command; a step
    whose box runs out takes its children with it (DDP's second rank outlived its parent before)."""
    import time

    from bench.gpu_check import CALL_LIMIT_S, MARGIN_S, _subprocess_step, time_boxes

    boxes = time_boxes()
    assert boxes["status"] == "passed" and CALL_LIMIT_S == 300, boxes
    assert all(boxes["facts"][f"call {c}"]["total_s"] <= CALL_LIMIT_S - MARGIN_S for c in "AB")
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    began = time.perf_counter()
    row = _subprocess_step("hangs", [sys.executable, "-c", child + "print('up', flush=True); time.sleep(60)"], 3)
    assert row["status"] == "timeout" and "up" in row["error"] and time.perf_counter() - began < 30, row


@pytest.mark.slow  # a cli.py process
def test_demo_smoke_runs_make_demos_command_and_reads_its_figures(tmp_path):
    from bench import demo

    result = demo.main(["--smoke", "--out", str(tmp_path)])
    (run,) = result["runs"]
    assert run["seed"] == 1234 and run["resident"] and run["steps"] == 5 and run["test_images"] == "512/10000"
    assert _finite_positive(run["wall_s"]) and 0 < run["test_acc1"] < 1 and result["before"] is None
    table = (tmp_path / "demo.md").read_text()
    assert "`python cli.py fit --test_after_fit best`" in table and "| seeds at or above 99.0% test accuracy |" in table


@pytest.mark.slow
@pytest.mark.distributed  # two 2-process gloo fits
def test_resident_smoke_reads_each_ranks_data_wait(tmp_path):
    from bench import resident

    result = resident.main(["--smoke", "--out", str(tmp_path)])
    for path in ("resident", "loader"):
        ranks = result["paths"][path]["per_rank"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(0 <= r["data_wait_of_step"] < 1 for r in ranks), ranks
    assert (tmp_path / "resident.md").read_text().count("| resident |") == 2
    _valid_png(tmp_path / "resident.png")


@pytest.mark.slow  # four python processes
def test_startup_smoke_splits_the_time_to_the_first_step(tmp_path):
    from bench import startup

    result = startup.main(["--repeats", "1", "--out", str(tmp_path)])
    assert list(result["split_s"]) == startup.LEGS and all(_finite_positive(v) for v in result["split_s"].values())
    assert set(result["floors_s"]) == set(startup.FLOORS)
    assert "The app adds" in (tmp_path / "startup.md").read_text()
    _valid_png(tmp_path / "startup.png")


@pytest.mark.slow  # 40 batches of the default recipe, then the test set
def test_mnist_recipe_smoke_chooses_on_validation_only(mnist_dir, tmp_path):
    from bench import mnist_recipe

    result = mnist_recipe.main(["--smoke", "--out", str(tmp_path)])
    (candidate,) = result["candidates"].values()
    assert 0.9 < candidate["val_acc1"]["mean"] < 1 and 0.9 < candidate["test_acc1"]["mean"] < 1
    chosen = candidate["val_acc1"]["mean"] >= mnist_recipe.TARGET
    assert result["chosen"] == (next(iter(result["candidates"])) if chosen else None)


def test_figures_are_drawn_from_the_committed_results(tmp_path):
    """``python -m bench.figures`` reads results files other benchmarks wrote (a copy of the committed ones here) and
    draws the first screen's picture and the GPU plots, naming in its table each figure's file."""
    from bench import figures
    from bench.common import RESULTS

    for name in ("mnist_time_to_accuracy.json", "mnist_time_to_accuracy_gpu.json", "gpu_check_B.jsonl"):
        shutil.copy(RESULTS / name, tmp_path / name)
    for found in [*RESULTS.glob("cpu_*.json"), *RESULTS.glob("gpu_*_NVIDIA-*.json")]:
        shutil.copy(found, tmp_path / found.name)
    figures.main(["--results", str(tmp_path)])
    assert all(
        (tmp_path / f"{name}.png").stat().st_size > 0 for name in ("first_screen", "gpu_throughput", "gpu_loader")
    )
    table = (tmp_path / "first_screen.md").read_text()
    h200 = json.loads((RESULTS / "gpu_2026-12-04_NVIDIA-H200.json").read_text())
    bf16 = next(r for r in h200["throughput"] if r["config"] == "bf16 channels_last")
    assert f"| 1x NVIDIA H200 | {bf16['img_per_s']:,.0f} | `gpu_2026-12-04_NVIDIA-H200.json` |" in table
    assert "| 2 CPU cores | 5.1 | `mnist_time_to_accuracy.json` |" in table


def test_recipe_cost_smoke_measures_each_part_of_the_modern_recipe(tmp_path):
    from bench import recipe_cost

    result = recipe_cost.main(["--smoke", "--out", str(tmp_path)])
    rows = result["rows"]
    assert len(rows) == 5 and all(_finite_positive(row["modern_s"]) for row in rows.values()), rows
    assert all(
        _finite_positive(row["classic_s"])
        for name, row in rows.items()
        if "mixing" not in name and "average" not in name
    )
    assert "Per step of 4 images" in (tmp_path / "recipe_cost_cpu_smoke.md").read_text()


def test_imagenet_e2e_steps_never_wait_for_the_gpu(monkeypatch):
    """The end-to-end bench's clock on CUDA (its events stood in for on the CPU): each training and evaluation step
    records a mark and nothing synchronizes; one synchronize reads the marks when the fit is over, and the rates are
    the images of the timed steps over the events' time."""
    from types import SimpleNamespace

    import torch

    from bench.imagenet_e2e import clock

    syncs, times = [], iter(range(100))

    class Event:  # a recorded CUDA event whose time is the order in which it was recorded (one second apart)
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            assert not syncs, "a mark waited for the device"
            self.at = next(times)

        def elapsed_time(self, end: Event) -> float:
            assert syncs, "read before the device finished"
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    monkeypatch.setattr(torch.cuda, "utilization", lambda *a: 50)
    watch, trainer, batch = clock("cuda", warmup=2), SimpleNamespace(train_dataloader=None), (None, [0] * 4)
    watch.on_fit_start(trainer, None)
    for i in range(6):
        watch.on_train_batch_start(trainer, None, batch, i)
        watch.on_train_batch_end(trainer, None, None, batch, i)
    for i in range(5):
        watch.on_validation_batch_start(trainer, None, batch, i)
        watch.on_validation_batch_end(trainer, None, None, batch, i)
    assert not syncs  # 11 steps, no synchronize
    rates = watch.rates()
    # marks: fit 0, first step 1, start 2, ends 3..6; evaluation start 7, ends 8, 9, 10
    assert rates == {"seconds": 4.0, "img_per_s": 16 / 4, "eval_img_per_s": 12 / 3, "first_step_s": 1.0}
    assert syncs and watch.utilisation == [50.0] * 4


def test_imagenet_e2e_smoke_times_training_and_evaluation_on_1000_classes(tmp_path):
    """The CPU smoke of one JPEG fit: a row with the training and the evaluation rates, over 1000 class folders."""
    from bench.imagenet_e2e import main

    results = main(["--smoke", "--no-restart", "--decoders", "cpu", "--out", str(tmp_path)])
    rows = {r["input"]: r for r in results["rows"]}
    assert set(rows) == {"synthetic", "JPEG files, decode cpu"} and not [r for r in rows.values() if "error" in r]
    assert all(r["img_per_s"] > 0 and r["eval_img_per_s"] > 0 for r in rows.values())
    assert "evaluation img/s" in (tmp_path / "imagenet_e2e_cpu_smoke.md").read_text()
