"""Max |difference| of the final weights between an uninterrupted run and the same run stopped by SIGTERM mid-epoch
and resumed with ``--ckpt_path last``, and whether every rank trained the same samples, per scenario.

    python -m bench.resume_exact after             # this checkout -> bench/results/resume_exact_after.json
    PYTHONPATH=<main checkout>:. python -m bench.resume_exact before --data data   # an older checkout ("before")
    python -m bench.resume_exact --table           # both -> bench/results/resume_exact.md

The legs are those of ``tests/distributed/test_resume_anywhere.py`` (real CLI, real signal; ddp/allreduce in one
2-process gloo torchrun job). ``issue_*``: the issue's scenario, 12 batches per epoch, stopped after global step 17.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# name: (strategy args or None for one device, num_workers, batches per epoch, stop step, ImageNet photos)
SINGLE = {
    "issue_single_w2": (None, 2, 12, 17, False),
    "single_w0": (None, 0, 6, 9, False),
    "single_w2": (None, 2, 6, 9, False),
    "imagenet_photos_w2": (None, 2, 6, 9, True),
}
DISTRIBUTED = {
    "issue_ddp_w2": (["--trainer.strategy", "ddp"], 2, 12, 17, False),
    "ddp_w0": (["--trainer.strategy", "ddp"], 0, 6, 9, False),
    "allreduce_w2": (["--trainer.strategy", "allreduce"], 2, 6, 9, False),
}


def run(names: dict, out: Path, data: str, photos: str | None, ranks: int, extra: list[str]) -> dict:
    from tests.distributed.test_resume_anywhere import imagenet_args, legs, mnist_args

    results = {}
    for name, (strategy, workers, batches, stop, imagenet) in names.items():
        args = imagenet_args(out, photos, workers) if imagenet else mnist_args(out, data, workers)
        facts = legs(out / name, args, [*(strategy or []), *extra], ranks=ranks, stop=stop, batches=batches)
        results[name] = {
            "max_diff": facts["max_diff"],
            "saved_step": facts["saved_step"],
            "samples_same_every_rank": all(s["same"] for s in facts["samples"].values()),
            "repeats_in_stopped_epoch": sum(s["epoch1_repeats"] for s in facts["samples"].values()),
        }
    return results


def job(out: Path, data: str) -> None:
    import torch.distributed as dist

    results = run(DISTRIBUTED, out, data, None, 2, ["--trainer.devices", "2", "--launch.timeout", "120"])
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.barrier()


def table() -> str:
    before = json.loads((RESULTS / "resume_exact_before.json").read_text())
    after = json.loads((RESULTS / "resume_exact_after.json").read_text())
    lines = [
        "# Mid-epoch SIGTERM, then `--ckpt_path last`: the resumed run against the uninterrupted one",
        "",
        "`python -m bench.resume_exact before|after`, then `--table` (CPU, 2 gloo processes for ddp/allreduce).",
        "",
        "| scenario | stop after step | max abs diff before | after | same samples every rank before | after |",
        "|---|---|---|---|---|---|",
    ]
    for name in after:
        b, a = before.get(name, {}), after[name]
        lines.append(
            f"| {name} | {a['saved_step']} | {b.get('max_diff', '-'):.4g} | {a['max_diff']:.4g} | "
            f"{b.get('samples_same_every_rank', '-')} | {a['samples_same_every_rank']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", nargs="?", default="after")
    parser.add_argument("--data", default="data")
    parser.add_argument("--workdir", default="/tmp/resume_exact")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.table:
        (RESULTS / "resume_exact.md").write_text(table())
        print(table())
        return
    from app.launch.torchrun import run_torchrun_job
    from tests.unit.test_imagenet import build_photo_imagenet

    out = Path(args.workdir) / args.label
    photos = str(build_photo_imagenet(out / "photos"))
    sys.argv = sys.argv[:1]  # the CLI legs parse their own arguments
    results = run(SINGLE, out / "single", str(Path(args.data).resolve()), photos, 1, [])
    job_out = out / "job"
    job_out.mkdir(parents=True, exist_ok=True)
    results.update(
        run_torchrun_job(
            "bench.resume_exact",
            ["--job", str(job_out), str(Path(args.data).resolve())],
            2,
            job_out / "results.json",
            "resume_exact",
            timeout=1800,
        )  # fmt: skip
    )
    (RESULTS / f"resume_exact_{args.label}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        job(Path(sys.argv[2]), sys.argv[3])  # one rank of the torchrun job
    else:
        main()
