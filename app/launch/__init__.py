"""Launch: the preflight (``preflight`` builds the ``plan``, ``checks`` checks it), the rendezvous timeout explained
(``rendezvous``) and the end of the process group (``group``). The launcher's variables are :mod:`core.env`; the
sbatch script and its ``submit`` command are tools (:mod:`tools.sbatch`, :mod:`tools.slurm`)."""
