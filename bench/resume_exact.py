"""Max |difference| of the final weights between an uninterrupted run and the same run stopped mid-epoch and resumed
with ``--ckpt_path last``, and whether every rank trained the same samples, per scenario.

    python -m bench.resume_exact after                          # this checkout -> bench/results/resume_exact_after.json
    git worktree add --detach ../before OLD_COMMIT
    python -m bench.resume_exact before --app ../before         # the legs below driving an older checkout's app
    python -m bench.resume_exact --table                        # both -> bench/results/resume_exact.{md,png}

The legs are :mod:`tools.resume_legs`, those of ``tests/distributed/test_resume_anywhere.py`` (real CLI, real signal),
every scenario it tests: one device in this process, the 2-process ones (``tools.resume_legs.scenarios``) in one gloo
torchrun job. ``issue_*``: the issue's scenario, 12 batches per epoch, stopped after global step 17. ``--app``:
``app``, ``datamodules``, ``modules`` and ``configs`` come from that checkout; ``bench`` and ``tools`` (the legs, the
probe callbacks) from this one; its app must have ``app.strategies.modes`` (or, older, ``app.strategies.layout``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]

# name: (strategy/trainer args, num_workers, batches per epoch, stop step, ImageNet photos)
SINGLE = {
    "issue_single_w2": ([], 2, 12, 17, False),
    "single_w0": ([], 0, 6, 9, False),
    "single_w2": ([], 2, 6, 9, False),
    "imagenet_photos_w2": ([], 2, 6, 9, True),
    # the SIGTERM after step 3 lands inside an accumulation: the stop waits for step 4 (epoch 1, batch 1)
    "accumulate_2_w0": (["--trainer.accumulate_grad_batches", "2"], 0, 6, 4, False),
}


# The modes come from the registry of the app bound by use_app, so ``app`` is imported inside these functions.
def app_modes() -> tuple:
    """The bound app's reference mode, ``declared_modes`` and ``layout_of``."""
    import app.strategies  # noqa: F401  (registers the app's strategy names)

    try:
        from app.strategies.modes import REFERENCE, declared_modes
        from core.layout import layout_of
    except ImportError:  # an --app checkout from before the layout lookup moved to core.layout
        from app.strategies.layout import REFERENCE, declared_modes, layout_of
    return REFERENCE, declared_modes, layout_of


def one_process_modes() -> dict:
    """Every declared mode that runs one process (``dp``: its CPU path), in this process like the single device."""
    _, declared_modes, layout_of = app_modes()
    one = [m for m in declared_modes() if layout_of(m).one_process]
    return {f"{m}_w0": (["--trainer.strategy", m], 0, 6, 9, False) for m in one}


def issue_ddp() -> dict:
    """The issue's 2-process scenario on the reference mode, 12 batches per epoch, stopped after step 17."""
    reference = app_modes()[0]
    return {f"issue_{reference}_w2": (["--trainer.strategy", reference], 2, 12, 17, False)}


def use_app(checkout: str | None) -> None:
    """Imports ``app``, ``datamodules``, ``modules`` (and reads ``configs``) from ``checkout`` from now on; ``tools``
    is bound to this checkout first, so the legs keep coming from here."""
    if checkout:
        import tools  # noqa: F401

        sys.path.insert(0, checkout)
        os.chdir(checkout)


def run(names: dict, out: Path, data: str, photos: str | None, ranks: int, extra: list[str]) -> dict:
    from tools.resume_legs import imagenet_args, legs, mnist_args

    results = {}
    for name, (strategy, workers, batches, stop, imagenet) in names.items():
        args = imagenet_args(out, photos, workers) if imagenet else mnist_args(out, data, workers)
        try:
            facts = legs(out / name, args, [*strategy, *extra], ranks=ranks, stop=stop, batches=batches)
        except (Exception, SystemExit) as failed:  # an older app may not run a scenario: say why in the table
            results[name] = {"error": f"{type(failed).__name__}: {failed}"[:300]}
            continue
        results[name] = {
            "max_diff": facts["max_diff"],
            "saved_step": facts["saved_step"],
            "samples_same_every_rank": all(s["same"] for s in facts["samples"].values()),
            "repeats_in_stopped_epoch": sum(s["epoch1_repeats"] for s in facts["samples"].values()),
        }
    return results


def without_signal(out: Path, data: str) -> dict:
    """The two mid-epoch stops that write their checkpoint without a signal, as the test does them: the step-9 save of
    ``ModelCheckpoint(every_n_train_steps=9)`` resumed, and ``--trainer.max_steps 9`` raised with ``--ckpt_path last``.
    """
    import torch

    from tools.resume_legs import STOP, fit, max_diff, mnist_args, trail

    args = mnist_args(out, data, 0)
    every = [
        "--checkpoint.every_n_train_steps", str(STOP), "--checkpoint.monitor", "null", "--checkpoint.save_top_k", "-1",
        "--checkpoint.filename", "step{step}",
    ]  # fmt: skip
    full = fit(out / "every", args, every)  # also the uninterrupted run of both
    mid = out / "every" / "version_0" / "checkpoints" / f"step{STOP}.ckpt"
    resumed = fit(out / "from_every", args, ["--ckpt_path", str(mid)])
    fit(out / "max_steps", args, ["--trainer.max_steps", str(STOP)])
    last = out / "max_steps" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["global_step"]
    raised = fit(out / "max_steps", args, ["--trainer.max_steps", "-1", "--ckpt_path", "last"])
    weights = full.model.state_dict()
    return {
        "every_n_train_steps_w0": {
            "max_diff": max_diff(weights, resumed.model.state_dict()),
            "saved_step": torch.load(mid, weights_only=True)["global_step"],
            "samples_same_every_rank": trail(out / "from_every") == trail(out / "every")[STOP:],
        },
        "max_steps_raised_w0": {
            "max_diff": max_diff(weights, raised.model.state_dict()),
            "saved_step": saved,
            "samples_same_every_rank": trail(out / "max_steps") == trail(out / "every"),
        },
    }


def job(out: Path, data: str) -> None:
    """One rank of the torchrun job: the issue's ddp scenario, then every 2-process scenario of the test."""
    use_app(os.environ.get("RESUME_EXACT_APP"))
    import torch.distributed as dist

    from tools.resume_legs import scenarios

    two = {name: (extra, workers, 6, 9, False) for name, (extra, workers) in scenarios().items()}
    results = run({**issue_ddp(), **two}, out, data, None, 2, ["--trainer.devices", "2", "--launch.timeout", "120"])
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.barrier()


def distributed(out: Path, data: str, app: str | None) -> dict:
    """The torchrun job, started here (not by the app's launcher: an older one would start it in its own checkout)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESUME_EXACT_APP": app or ""}
    job = [*command, "-m", "bench.resume_exact", "--job", str(out), data]
    subprocess.run(job, cwd=ROOT, env=env, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())


def cell(result: dict, key: str, notes: list[str]) -> str:
    if "error" in result:
        if result["error"] not in notes:
            notes.append(result["error"])
        return f"- [{notes.index(result['error']) + 1}]"
    value = result.get(key, "-")
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table() -> str:
    before = json.loads((RESULTS / "resume_exact_before.json").read_text())
    after = json.loads((RESULTS / "resume_exact_after.json").read_text())
    meta = before.pop("_run", {}), after.pop("_run", {})
    lines = [
        "# Mid-epoch stop, then `--ckpt_path last`: the resumed run against the uninterrupted one",
        "",
        f"`python -m bench.resume_exact before --app <checkout of {meta[0].get('app', '?')}>`, then `after` "
        f"(at {meta[1].get('app', '?')}), then `--table`. CPU, 2 gloo processes for ddp, allreduce* and ddp_mp. "
        "A SIGTERM after the step, except `every_n_train_steps_w0` (its step-9 save resumed) and "
        '`max_steps_raised_w0` (`--trainer.max_steps 9`, then `-1` with `--ckpt_path last`). "saved at step": the '
        "checkpoint the old app resumed from, where it is not the stop's step.",
        "",
        "| scenario | stop after step | max abs diff before | after | same samples every rank before | after |",
        "|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for name in after:
        b, a = before.get(name, {"error": "not measured before"}), after[name]
        moved = "saved_step" in b and b["saved_step"] != a.get("saved_step")  # the old app saved elsewhere
        row = [
            cell(b, "max_diff", notes) + (f" (saved at step {b['saved_step']})" if moved else ""),
            cell(a, "max_diff", notes),
        ]
        row += [cell(b, "samples_same_every_rank", notes), cell(a, "samples_same_every_rank", notes)]
        lines.append(f"| {name} | {cell(a, 'saved_step', notes)} | {' | '.join(row)} |")
    lines += ["", *(f"- [{i}] {note}" for i, note in enumerate(notes, 1))] if notes else []
    return "\n".join(lines) + "\n"


def plot(path: Path) -> Path:
    """The table as a picture: per scenario, max |difference| of the final weights before and after (0 drawn as a
    small floor on a log axis, labelled 0), from the committed results files."""
    from bench.common import figure

    before = json.loads((RESULTS / "resume_exact_before.json").read_text())
    after = json.loads((RESULTS / "resume_exact_after.json").read_text())
    names = [n for n in after if not n.startswith("_")]
    floor = 1e-4
    with figure(path, figsize=(8, 0.32 * len(names) + 1.4)) as (_, ax):
        for offset, (label, results, color) in enumerate(
            (("before", before, "tab:red"), ("after", after, "tab:green"))
        ):
            values = [results.get(n, {}).get("max_diff") for n in names]
            ys = [i + 0.2 * (offset * 2 - 1) for i in range(len(names))]
            ax.barh(ys, [max(v, floor) if v is not None else 0 for v in values], height=0.38, color=color, label=label)
            for name, y, v in zip(names, ys, values, strict=True):
                saved, stop = results.get(name, {}).get("saved_step"), after[name].get("saved_step")
                if v == 0:  # the old app's 0 of max_steps_raised came from resuming at another step
                    moved = f", but resumed from step {saved}" if saved != stop else ""
                    ax.text(floor * 1.3, y, f"0{moved}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("max |difference| of the final weights, resumed vs uninterrupted (log; 0 = bit for bit)")
        ax.set_title("Stopped mid-epoch, resumed with --ckpt_path last (CPU)", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    return path


def revision(checkout: str) -> str:
    return subprocess.check_output(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], text=True).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", nargs="?", default="after")
    parser.add_argument("--app", help="an older checkout whose app the legs drive (default: this one)")
    parser.add_argument("--data", default="data")
    parser.add_argument("--workdir", default="/tmp/resume_exact")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.table:  # the table and its plot, from the committed results files
        (RESULTS / "resume_exact.md").write_text(table())
        print(table())
        print(f"wrote {plot(RESULTS / 'resume_exact.png')}")
        return
    data, out = str(Path(args.data).resolve()), Path(args.workdir).resolve() / args.label
    app = str(Path(args.app).resolve()) if args.app else None
    shutil.rmtree(out, ignore_errors=True)  # the legs read version_0 and append to the sample logs
    use_app(app)
    from tools.photos import build_photo_imagenet

    photos = str(build_photo_imagenet(out / "photos"))
    sys.argv = sys.argv[:1]  # the CLI legs parse their own arguments
    jobs = distributed(out / "job", data, app)  # first: this process is small while the job runs
    results = {
        **run({**SINGLE, **one_process_modes()}, out / "single", data, photos, 1, []),
        **without_signal(out / "without_signal", data),
    }
    results.update(jobs)
    results["_run"] = {"app": revision(app or str(ROOT))}
    (RESULTS / f"resume_exact_{args.label}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        job(Path(sys.argv[2]), sys.argv[3])  # one rank of the torchrun job
    else:
        main()
