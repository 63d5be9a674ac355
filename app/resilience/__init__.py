"""Resilience: what a job does when it is stopped or fails, so that it resumes or heals instead of hanging.

Every kind of fault and its translator, in one list: :mod:`~app.resilience.faults`. Their detectors: a stuck rank
(:mod:`~app.resilience.hang_watch`), a lost rank (:mod:`~app.resilience.lost_rank`). A stop at a step boundary with a
checkpoint: SIGTERM and Ctrl-C (:mod:`~app.resilience.sigterm`), SLURM's preemption (:mod:`~app.resilience.preemption`),
on every rank at once by the ranks' agreement (:mod:`~app.resilience.agree`). After a fault, a SLURM job requeues
itself (:mod:`~app.resilience.requeue`); torch's elastic agent restarts the others (:mod:`app.launch.elastic`).
"""
