"""The app's Lightning extensions. Importing it registers the project's strategy names (``dp``, ``allreduce``,
``ddp_mp``) in Lightning's StrategyRegistry, so LightningCLI accepts them."""

from app import strategies  # noqa: F401  (import registers the strategies)
