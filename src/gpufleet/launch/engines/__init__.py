"""Where processes run: one subpackage per engine (``local``, ``ray``, ``slurm``).

Each engine places the ranks or node commands of one attempt, starts them, polls and stops them,
and gives back what it held (GPU leases, Ray actors and placement groups, a Slurm job). The
controller (``launch/controller.py``) drives an engine's group through ``launch/group.py``'s
``WorkerGroup``; the engines never import one another, nor a front door (``api``, ``workload``).
"""
