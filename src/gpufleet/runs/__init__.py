"""The run model: every run gpufleet starts, a decorated call's and a YAML workload's alike.

A run has an id, a state (:mod:`gpufleet.states`), and one or more attempts, numbered from 1
everywhere (the run store, ``gpufleet get``/``logs``, MLflow, ``GPUFLEET_ATTEMPT`` in every rank).
This package keeps them: the run store (:mod:`.store`, an embedded SQLite database, and its
schema versions in :mod:`.migrations`), the records it reads and writes with the small files
beside them (:mod:`.records`), the one recorder that writes what the controller does
(:mod:`.recorder`, with a decorated call's kind of run in :mod:`.calls`), the check that a run
whose supervisor is gone is marked FAILED and stopped when it is read (:mod:`.liveness`), and
the commands and views that show runs of every kind (:mod:`.commands`, :mod:`.view`, :mod:`.ps`).

It imports neither front door: the decorator (:mod:`gpufleet.api`) and the workloads
(:mod:`gpufleet.workload`) read and write runs through it.
"""
