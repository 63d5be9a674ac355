"""Launch: the preflight (``preflight`` builds the ``plan``, ``checks`` checks it), the launcher's variables
(``env``), the rendezvous timeout explained (``rendezvous``), the end of the process group (``group``), one torchrun
job (``torchrun``) and the sbatch script (``slurm``; its command is ``app.slurm``)."""
