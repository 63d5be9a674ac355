"""The ground everything stands on: errors with their help anchors (``errors``), config helpers (``config``), the
launch environment (``env``), the logging-step rule (``logging_steps``), the batch arithmetic (``batch``) and the
DataModule contract (``datamodule``). Imports nothing else of this project."""
