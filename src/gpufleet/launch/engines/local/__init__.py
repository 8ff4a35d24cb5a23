"""The local engine: ranks as child processes of the calling process on this machine, and the warm
pool that keeps them between calls (``group``, ``warm``, ``warm_worker``, ``warm_state``)."""
