"""Train, validate, test or predict: ``python cli.py fit [--config configs/mnist.yaml] [--config ...]``."""

import gc

# torch, Lightning and torchvision leave millions of objects that live as long as the process; Python's cyclic
# collector would walk them over and over while they load and at each full collection after. It is off while they
# load, and what they left is frozen (gc.freeze: out of its reach): every rank, every restart starts in less CPU time
# (python -m bench.startup, results/startup.md). Garbage made later is collected as usual.
gc.disable()
from app.command import main  # noqa: E402
from app.launch.group import process_group_ended  # noqa: E402

gc.freeze()
gc.enable()

if __name__ == "__main__":
    # every rank ends its process group before Python finalizes, or a gloo thread can abort the exit (app/launch/group);
    # a user mistake or fault ends main() with its one line already said (app.command.user_errors_explained)
    with process_group_ended():
        main()
