"""The test suite (``make test``).

The suite runs two pytest workers on as many cores, and each starts processes that compute with all the cores' OpenMP
threads, so there are more busy threads than cores. An OpenMP thread that has finished its share of an operation
spins (GNU OpenMP: up to 300,000 times) waiting for the next, on a core another process needs; ``PASSIVE`` makes it
sleep instead: the same threads and the same results bit for bit, in less time when two runs share the cores
(``python -m bench.omp_wait``, ``bench/results/omp_wait.md``). Set here, before any test module imports torch (OpenMP
reads it when torch loads it), and inherited by every process a test starts.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
