"""Launch helpers: the preflight plan, SLURM submission, environment detection."""
