"""The Ray engine: one actor per rank or node in a placement group, each owning its child process
(``group``; ``actor``, which runs on the nodes; ``connect``, the connection and the job's runtime_env)."""
