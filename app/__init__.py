"""The app's Lightning extensions: strategies, callbacks, launch (preflight plan, SLURM), checkpoints, loggers and
the CLI that wires them. Importing a module here registers nothing; ``app.strategies`` registers the strategy names
in Lightning's StrategyRegistry when imported (``app.command`` does so where the CLI starts)."""
