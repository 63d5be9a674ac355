"""Launch: the preflight (``preflight`` builds the ``plan``, ``checks`` checks it), the rendezvous timeout explained
(``rendezvous``), the end of the process group (``group``) and the hand-off to torch's elastic agent
(``elastic``, ``--launch.max_restarts``). The launcher's variables are :mod:`core.env`; the
sbatch script and its ``submit`` command are tools (:mod:`tools.sbatch`, :mod:`tools.slurm`)."""
