"""Train, validate, test or predict: ``python cli.py fit [--config configs/mnist.yaml] [--config ...]``."""

from core.loading import unwatched

with unwatched():  # every rank, restart and requeue starts in less CPU time (core/loading.py)
    from app.command import main
    from app.launch.group import process_group_ended

if __name__ == "__main__":
    # every rank ends its process group before Python finalizes, or a gloo thread can abort the exit (app/launch/group);
    # a user mistake or fault ends main() with its one line already said (app.command.user_errors_explained)
    with process_group_ended():
        main()
