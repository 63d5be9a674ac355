"""The development-only packages that the app never imports: matplotlib (the benchmarks' figures) and scipy (the
ImageNet devkit's ``meta.mat`` in its test), kept by ``make venv`` in ``.venv/extras``, off the interpreter's path.

Installed into the environment itself, they are found by torchmetrics (imported by Lightning), which then imports
``scipy.signal`` and ``matplotlib.pyplot`` in every process: ``import app.command`` took 4.9 CPU-s on this
project's 2-core test machine instead of a user's 3.5 (an environment without them), in each of the test suite's ~300
processes. What needs them calls :func:`use_dev_extras` first; the real photos come out of the wheels of
scikit-image, scikit-learn and matplotlib into ``.venv/photos`` (``tools.photos``), no install needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXTRAS = Path(sys.prefix) / "extras"


def use_dev_extras() -> None:
    """Puts ``.venv/extras`` at the end of ``sys.path`` (the environment's own packages go first), when it exists."""
    if EXTRAS.is_dir() and str(EXTRAS) not in sys.path:
        sys.path.append(str(EXTRAS))
