"""The ground everything stands on: errors with their help anchors (``errors``), config helpers (``config``), the
launch environment (``env``), the logging-step rule (``logging_steps``), the batch arithmetic (``batch``), the
DataModule contract (``datamodule``), the atomic write (``files``) and loading the app unwatched by the garbage
collector (``loading``). Imports nothing else of this project."""
