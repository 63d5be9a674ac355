"""The README stays a first screen, the docs site has no page a reader cannot reach, stays within its word budget,
and says what has run on a GPU in one place only.

`mkdocs build --strict` (in `.ci/run` and `make docs`) checks links and anchors; these checks need no mkdocs and run
in the fast tier, so a page added without its nav entry, a README or a page grown back, or a status box written by
hand fails before CI does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tools.docs_screenshots import nav_pages  # the same reading of the nav as the screenshots'
from tools.docs_snippets import SNIPPETS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUDGET, PAGE_BUDGET = 15_000, 1_500  # hand-written words (wc -w) in docs/, and in any one page
STATUS = DOCS / "snippets" / "gpu-status.md"
INCLUDE_STATUS = '--8<-- "docs/snippets/gpu-status.md"'
# pages with a status box: the first screen, the tutorials, and the pages whose commands need GPUs to mean much
STATUS_PAGES = [
    "index.md", "tutorial/first-run.md", "tutorial/imagenet.md", "tutorial/cluster.md",
    "how-to/imagenet-one-node.md", "how-to/slurm-resnet50.md", "how-to/gpu-check.md",
    "explanation/parallel-modes.md", "reference/launching.md", "reference/data.md", "reference/benchmarks.md",
]  # fmt: skip
# how a page would state a GPU status of its own (each matched a status box or sentence of this site once)
OWN_STATUS = re.compile(
    r"verified on CPUs?|not yet on a GPU|on a GPU yet|(has|have) (not |never )?(yet )?run (on|yet)|"
    r"never (been )?run|(ran|passed) on (one|an?) (NVIDIA )?(H200|GPU)|untested|not (yet )?(been )?(run|tested|"
    r"verified) on",
    re.IGNORECASE,
)


def hand_written() -> dict[str, int]:
    """``wc -w`` of every hand-written file under docs/ (the generated snippets left out), by path."""
    generated = {str(Path(path).relative_to("docs")) for path in SNIPPETS}
    files = [p for p in DOCS.rglob("*") if p.suffix == ".md" and str(p.relative_to(DOCS)) not in generated]
    return {str(p.relative_to(DOCS)): len(p.read_text().split()) for p in sorted(files)}


def test_readme_is_a_first_screen_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail into a page under docs/"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = nav_pages(config["nav"])
    pages = (p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    on_disk = sorted(p for p in pages if not p.startswith("snippets/"))  # mkdocs.yml's exclude_docs
    assert sorted(set(in_nav)) == on_disk, "docs/ pages and mkdocs.yml's nav differ"
    assert len(in_nav) == len(set(in_nav)), "a page is twice in the nav"


def test_the_readme_links_only_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t}
    missing = sorted(t for t in targets if t and not (ROOT / t).exists())
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_docs_stay_within_their_word_budget():
    words = hand_written()
    assert "snippets/gpu-status.md" in words and "snippets/resnet50_epoch.md" not in words  # the status is counted
    over = {page: n for page, n in words.items() if n > PAGE_BUDGET}
    assert not over, f"pages over {PAGE_BUDGET} words: {over}"
    assert sum(words.values()) <= BUDGET, f"{sum(words.values())} hand-written words in docs/, budget {BUDGET}"


def status_sentence() -> str:
    """The snippet's status, as one line of text (its admonition's body, unindented)."""
    body = STATUS.read_text().split("\n", 1)[1]
    return " ".join(body.split())


@pytest.mark.parametrize("page", STATUS_PAGES)
def test_a_status_box_is_the_one_snippet(page):
    assert INCLUDE_STATUS in (DOCS / page).read_text(), f"docs/{page} has no status box: include {INCLUDE_STATUS}"


def test_no_page_states_a_gpu_status_of_its_own():
    sentence = status_sentence()
    assert OWN_STATUS.search(sentence), "the snippet itself should state the status"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert sentence in readme, "README.md's status is not the snippet's sentence, word for word"
    texts = {"README.md": readme.replace(sentence, "")}
    texts |= {f"docs/{p.relative_to(DOCS)}": p.read_text() for p in DOCS.rglob("*.md") if p != STATUS}
    own = {path: found.group(0) for path, text in texts.items() if (found := OWN_STATUS.search(text))}
    assert not own, f"pages that state a GPU status of their own (include the snippet instead): {own}"


# A GPU figure: a sentence that names a GPU and gives a rate in images/s, or a table row that names a GPU and has a
# number under a header in images/s. It carries its measurement's tag in the same sentence or row: "(YYYY-MM-DD,
# commit abcdef1, ..., torch X.Y...", the GPU being named already (docs/snippets/resnet50_epoch.md's rows get theirs
# from tools/docs_snippets.py).
GPU = re.compile(r"\b(?:[ABHL]\d{2,3}|GPUs?)\b")
RATE = re.compile(r"(?<![\w-])\d[\d,.]*\s*(?:img/s|images/s|images per second)")
UNIT = re.compile(r"img/s|images/s|images per second")
TAG = re.compile(r"\d{4}-\d{2}-\d{2}, commit [0-9a-f]{7,40}\b[^.]{0,60}?torch \d+\.\d+")


def gpu_figures(text: str) -> list[str]:
    """A page's GPU figures: its prose sentences and table rows that name a GPU and give a rate (code blocks left
    out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        rows = [line for line in lines if line.startswith("|")]
        for row in rows[2:]:
            if GPU.search(row) and (RATE.search(row) or (UNIT.search(rows[0]) and re.search(r"\d", row))):
                found.append(row)
        prose = " ".join(line for line in lines if not line.startswith("|"))
        found += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\[(`*])", prose) if GPU.search(s) and RATE.search(s)]
    return found


def undated_gpu_figures(texts: dict[str, str]) -> list[str]:
    return [f"{path}: {f[:160]}" for path, text in texts.items() for f in gpu_figures(text) if not TAG.search(f)]


def test_every_gpu_figure_says_when_where_and_on_what_it_was_measured():
    texts = {"README.md": (ROOT / "README.md").read_text()}
    texts |= {f"docs/{p.relative_to(DOCS)}": p.read_text() for p in sorted(DOCS.rglob("*.md"))}
    undated = undated_gpu_figures(texts)
    assert not undated, f"GPU figures without (date, commit, torch) of their results file: {undated}"
    tag = "(2026-12-04, commit 7458fc7, torch 2.11.0+cu130, NVIDIA H200)"
    assert undated_gpu_figures({"x": "One H200 trains 4,564 img/s. Fine."})
    assert not undated_gpu_figures({"x": f"One H200 trains 4,564 img/s {tag}. ResNet-50 images/s on a GPU."})
    assert undated_gpu_figures({"x": "| GPU | images/s |\n|---|---|\n| NVIDIA H200 | 4,564 |"})
    assert not undated_gpu_figures({"x": f"| GPU | images/s |\n|---|---|\n| NVIDIA H200 | 4,564 {tag} |"})


def test_the_cluster_tutorials_quoted_plan_has_the_recipes_batch():
    """The plan quoted under the tutorial's torchrun command (2 processes, the default recipe) is what the app prints
    for it (it once said 128 per device while the recipe loads 256); the page's block itself runs in
    tests/e2e/test_docs_commands.py."""
    per_device = yaml.safe_load((ROOT / "configs" / "mnist.yaml").read_text())["data"]["init_args"]["batch_size"]
    page = (DOCS / "tutorial" / "cluster.md").read_text()
    assert "--nproc_per_node 2" in page and f"batch        {per_device} per device, global {2 * per_device}\n" in page
