"""The val-folder helper on a synthetic flat folder: every label format, symlinks only, mistakes named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from datamodules.imagenet import ImageNetDataModule
from datamodules.imagenet_val import ValLayoutError, arrange, main
from tests.troubleshooting import assert_documented

ROOT = Path(__file__).resolve().parents[2]
# 7 images of 3 classes, in the official naming; the ILSVRC2012_IDs are deliberately not in wnid order
TRUTH = ["n01440764", "n02102040", "n01440764", "n03000134", "n02102040", "n01440764", "n03000134"]
ILSVRC_ID = {"n02102040": 1, "n03000134": 2, "n01440764": 3}


@pytest.fixture
def flat(tmp_path) -> Path:
    folder = tmp_path / "ILSVRC2012_img_val"
    folder.mkdir()
    for i in range(1, len(TRUTH) + 1):
        Image.new("RGB", (40, 30), (40 * i, 255 - 30 * i, 128)).save(folder / f"ILSVRC2012_val_{i:08d}.JPEG")
    return folder


def _names(flat: Path) -> list[str]:
    return sorted(p.name for p in flat.iterdir())


def _check_tree(out: Path, flat: Path) -> None:
    links = sorted(out.glob("*/*"))
    assert len(links) == len(TRUTH)
    for link in links:
        assert link.is_symlink() and link.resolve().parent == flat.resolve()  # a link into the flat folder
        assert TRUTH[int(link.stem.rsplit("_", 1)[1]) - 1] == link.parent.name  # in its true class folder
    assert sum(1 for p in flat.iterdir()) == len(TRUTH)  # nothing moved or copied


def test_helper_command_with_kaggle_csv_then_imagefolder_reads_it(flat, tmp_path):
    labels = tmp_path / "LOC_val_solution.csv"
    rows = [f"{Path(n).stem},{w} 10 20 30 40 {w} 1 2 3 4" for n, w in zip(_names(flat), TRUTH, strict=True)]
    labels.write_text("ImageId,PredictionString\n" + "\n".join(reversed(rows)) + "\n")
    train = tmp_path / "imagenet" / "train"
    for wnid in set(TRUTH):
        (train / wnid).mkdir(parents=True)
        Image.new("RGB", (40, 30)).save(train / wnid / "a.JPEG")
    out = tmp_path / "imagenet" / "val"
    command = [sys.executable, "-m", "datamodules.imagenet_val", str(flat), str(labels), "--out", str(out)]
    done = subprocess.run([*command, "--train-dir", str(train)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "linked 7 images into 3 class folders" in done.stdout and "(symlinks, no copies)" in done.stdout
    _check_tree(out, flat)
    # the result is what the datamodule expects
    dm = ImageNetDataModule(data_dir=str(tmp_path / "imagenet"), num_workers=0, image_size=16, batch_size=7)
    dm.setup("validate")
    assert dm.val_set.classes == sorted(set(TRUTH)) and len(dm.val_set) == 7
    assert sorted(dm.val_set.classes[t] for _, t in dm.val_set.samples) == sorted(TRUTH)


def test_command_exits_non_zero_naming_the_cause(flat, tmp_path, capsys):
    labels = tmp_path / "labels.txt"
    labels.write_text("n01440764\n")
    assert main([str(flat), str(labels), "--out", str(tmp_path / "val")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has 1 labels (one per line) but 7 images were found" in err
    assert_documented(err, "imagenet-val-layout")


def test_name_label_pairs_and_rerun_is_a_no_op(flat, tmp_path):
    labels = tmp_path / "val.txt"
    labels.write_text("".join(f"{n}\t{w}\n" for n, w in zip(_names(flat), TRUTH, strict=True)))
    out = tmp_path / "val"
    assert arrange(flat, labels, out) == {"n01440764": 3, "n02102040": 2, "n03000134": 2}
    assert arrange(flat, labels, out) == {"n01440764": 3, "n02102040": 2, "n03000134": 2}
    _check_tree(out, flat)


def test_one_wnid_per_line(flat, tmp_path):
    labels = tmp_path / "wnids.txt"
    labels.write_text("\n".join(TRUTH) + "\n")
    arrange(flat, labels, tmp_path / "val")
    _check_tree(tmp_path / "val", flat)


def test_official_ground_truth_ids_through_the_devkit(flat, tmp_path):
    from scipy.io import savemat

    labels = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    labels.write_text("\n".join(str(ILSVRC_ID[w]) for w in TRUTH) + "\n")
    with pytest.raises(ValLayoutError, match="integer ILSVRC2012_IDs.*pass --devkit"):
        arrange(flat, labels, tmp_path / "val")
    # a devkit meta.mat in the official structure; it also lists inner nodes of the hierarchy (num_children > 0)
    fields = [
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    ]
    entries = [*ILSVRC_ID.items(), ("n00001740", 1001)]
    synsets = np.zeros((len(entries), 1), dtype=[(f, "O") for f in fields])
    for row, (wnid, idx) in enumerate(entries):
        synsets[row, 0] = (idx, wnid, f"class {wnid}", "", 0 if idx <= 1000 else 2, np.zeros((0,)), 0, 1300)
    (tmp_path / "devkit" / "data").mkdir(parents=True)
    savemat(tmp_path / "devkit" / "data" / "meta.mat", {"synsets": synsets})
    arrange(flat, labels, tmp_path / "val", devkit=tmp_path / "devkit")
    _check_tree(tmp_path / "val", flat)


def test_the_devkit_without_scipy_is_one_line_naming_the_install(flat, tmp_path):
    """scipy is no dependency of the app: the converter, started as a user starts it in an environment without scipy,
    says what to install. The tests' environment keeps scipy off the path (``tools.dev_extras``); one that has it
    installed (``make test-compat``'s) gets a ``scipy`` that cannot be imported first on the path, as if it had none."""
    labels = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    labels.write_text("\n".join(str(ILSVRC_ID[w]) for w in TRUTH) + "\n")
    (tmp_path / "devkit" / "data").mkdir(parents=True)
    absent = tmp_path / "without_scipy" / "scipy"
    absent.mkdir(parents=True)
    (absent / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'scipy'\", name='scipy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(absent.parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "datamodules.imagenet_val", str(flat), str(labels), "--out", str(tmp_path / "val")]
    command += ["--devkit", str(tmp_path / "devkit")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    assert (
        line.startswith("error: imagenet_val: reading the devkit's meta.mat needs scipy")
        and "pip install scipy" in line
    )


def test_mistakes_are_named(flat, tmp_path):
    names = _names(flat)
    short = tmp_path / "short.txt"
    short.write_text("".join(f"{n} {w}\n" for n, w in zip(names[:-1], TRUTH, strict=False)))
    with pytest.raises(ValLayoutError, match=f"1 images have no label in .*{names[-1]}"):
        arrange(flat, short, tmp_path / "val")
    stray = tmp_path / "stray.txt"
    stray.write_text("ILSVRC2012_val_00009999.JPEG n01440764\n")
    with pytest.raises(ValLayoutError, match="names no image in the folder"):
        arrange(flat, stray, tmp_path / "val")
    counted = tmp_path / "counted.txt"
    counted.write_text("n01440764\n")
    with pytest.raises(ValLayoutError, match="has 1 labels .* but 7 images"):
        arrange(flat, counted, tmp_path / "val")
    good = tmp_path / "good.txt"
    good.write_text("\n".join(TRUTH))
    occupied = tmp_path / "val" / TRUTH[0] / names[0]
    occupied.parent.mkdir(parents=True)
    occupied.write_bytes(b"a real file")
    with pytest.raises(ValLayoutError, match="exists and is not a link"):
        arrange(flat, good, tmp_path / "val")
    assert [p.name for p in (tmp_path / "val").glob("*/*")] == [names[0]]  # nothing linked before the check failed
    with pytest.raises(ValLayoutError, match="have no folder in .*the labels do not belong"):
        arrange(flat, good, tmp_path / "val2", train_dir=tmp_path / "val")
