"""Framework messages that tell a user of this app nothing they can act on, silenced by their exact text.

Each entry is narrow (one message, one origin) so that anything else Lightning or torch says still reaches the
user. Installed by :func:`app.command.main` (and so by every tool built on it), never at import.
"""

from __future__ import annotations

import logging
import warnings

# Lightning 2.6 logs an advertisement for its hosted logger at every Trainer construction without a LitLogger.
_LIGHTNING_TIPS = ("💡 Tip:",)


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_LIGHTNING_TIPS)


def _not_lightnings_zombie_line(record: logging.LogRecord) -> bool:
    # Lightning's child observer announces that it SIGKILLs every rank; the app replaces that with its own line and
    # exit (app.resilience.lost_rank.watch_the_start_up), so the announcement would be wrong
    return "Forcefully terminating all other processes to avoid zombies" not in str(record.msg)


def silence_known_noise() -> None:
    """Idempotent: the same filter object is added once however often it is called."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_tip)
    logging.getLogger("lightning.fabric.strategies.launchers.subprocess_script").addFilter(_not_lightnings_zombie_line)
    # lightning.pytorch.utilities._pytree builds torch's deprecated LeafSpec for every batch it moves; the fix is
    # Lightning's to make (torch asks for `TreeSpec.is_leaf()`), and the user can do nothing about it.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
