"""A folder put first on ``PYTHONPATH`` for a workload's command while it rehearses faults.

Its ``sitecustomize`` arms the faults in every rank as Python starts (see :mod:`gpufleet.faults`).
"""
