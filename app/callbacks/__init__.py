"""Callbacks that observe training: throughput, AMP health, stop at target accuracy, checkpoints."""
