"""The tools that stand on top of the app, imported by nothing of it: the parity check (``python -m tools.parity``),
SLURM submission (``python -m tools.slurm submit``, the script itself in ``sbatch``), one torchrun job on this machine
(``torchrun``), and the scripts that serve development (docs screenshots, the GPU machine's carry, soak loops)."""
