"""The Slurm engine: one batch job per attempt (``group``; ``job``, sbatch/squeue/scancel; ``node``,
the job's batch step and tasks on the nodes; ``stacks``, every task's stacks)."""
