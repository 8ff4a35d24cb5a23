"""What runs on a node beside the ranks, with the standard library only, by module or by path
(``python .../guard.py`` on a Ray node that lacks gpufleet's folder on its path): the guard that
leads a node command's process group (``guard``), the adopter of a rank's orphans (``adopted``),
process-group stops (``procgroup``), per-rank log lines (``ranklines``) and the run's environment
built on a node (``envs``). Nothing here may import beyond its siblings at the top level."""
