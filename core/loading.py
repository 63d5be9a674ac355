"""Loading torch, Lightning and the app without Python's cyclic garbage collector walking what they leave.

Their imports leave millions of objects that live as long as the process; the collector would walk them over and over
while they load, at each full collection after, and once more as the interpreter exits. :func:`unwatched` turns it
off while they load, then freezes what they left (``gc.freeze``: out of its reach) and turns it back on; garbage made
later is collected as usual. ``cli.py`` loads the app this way (``python -m bench.startup``, ``results/startup.md``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """The imports inside run with the collector off; what they left is frozen, then the collector is on again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
