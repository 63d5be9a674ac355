"""Train, validate, test or predict: ``python cli.py fit [--config configs/mnist.yaml] [--config ...]``."""

from app.cli import main
from app.launch.group import process_group_ended
from core.errors import exit_line_in_one_write

if __name__ == "__main__":
    # every rank ends its process group before Python finalizes, or a gloo thread can abort the exit (app/launch/group);
    # every rank's last line reaches the job's shared stderr in one write, never run into another rank's
    with exit_line_in_one_write(), process_group_ended():
        main()
