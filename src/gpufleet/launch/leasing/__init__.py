"""GPU leases on one machine: which run holds which GPU, and waiting for one.

``leases`` takes and releases ``flock``ed lock files per GPU, ``lease_files`` owns their folder
and holder records, ``gpu_processes`` finds NVML's processes outside gpufleet, and
``gpu_requests`` turns a call's ``gpus``/``gpu_wait`` into a request and a group's lease.
"""
