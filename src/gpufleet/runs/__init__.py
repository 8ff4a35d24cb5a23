"""The run model: every run gpufleet starts, a decorated call's and a YAML workload's alike.

A run has an id, a state (:mod:`gpufleet.states`), and one or more attempts. This package
keeps them: the run store (:mod:`.store`, an embedded SQLite database, and its schema versions
in :mod:`.migrations`), the records it reads and writes with the small files beside them
(:mod:`.records`), and the check that a run whose supervisor is gone is marked FAILED and
stopped when it is read (:mod:`.liveness`).

It imports nothing from :mod:`gpufleet.workload`: the workload front door, the call front door
(:mod:`gpufleet.registry`) and the CLI read and write runs through it.
"""
