"""The environment contract: the name of every environment variable gpufleet sets or reads.

Only names are written here (constants, no behaviour, no imports), so that anything may import
this module: the rank-side helpers, the launcher, and the node helpers beside this file that run
by path with the standard library only. Who writes the values: :mod:`gpufleet.launch.spec`
(``node_env`` and ``rank_env``: the torchrun variables and the run's own), the engines and the
supervisor (the rest of "launcher -> rank" and "supervisor/actor -> node"). Inside a rank the
torchrun variables are read through :mod:`gpufleet.runtime` only.

Each name has a ``#:`` line: who sets it, who reads it. ``tests/unit/test_env_contract.py``
checks that the rest of the source writes none of these names itself.
"""

# torchrun: what torchrun gives each worker; gpufleet's launchers give the same to its ranks.
#: Global rank of the process. Set by spec.rank_env (Slurm: slurm/node.py from SLURM_PROCID); read by runtime.
RANK = "RANK"
#: Rank on its node. Set by spec.rank_env (Slurm: slurm/node.py); read by runtime.
LOCAL_RANK = "LOCAL_RANK"
#: Number of ranks of the run. Set by spec.node_env; read by runtime.
WORLD_SIZE = "WORLD_SIZE"
#: Number of ranks on this node. Set by spec.node_env; read by runtime and the node helpers (ranklines).
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
#: Index of this node in the run. Set by spec.node_env (Slurm: slurm/node.py per node); read by runtime, ranklines.
NODE_RANK = "NODE_RANK"
#: Number of nodes of the run. Set by spec.node_env; read by runtime.
NUM_NODES = "NUM_NODES"
#: torchrun's name for the node index, set beside NODE_RANK by spec.rank_env; read by runtime as a fallback.
GROUP_RANK = "GROUP_RANK"
#: Global rank within the one role. Set by spec.rank_env; read by user code (torchrun's contract).
ROLE_RANK = "ROLE_RANK"
#: Number of ranks of the one role. Set by spec.rank_env; read by user code (torchrun's contract).
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
#: Host of the rendezvous store (rank 0's node). Set by spec.node_env; read by runtime and torch.distributed.
MASTER_ADDR = "MASTER_ADDR"
#: Port of the rendezvous store. Set by spec.node_env; read by runtime and torch.distributed.
MASTER_PORT = "MASTER_PORT"
#: The run's id, as torchrun sets it. Set by spec.rank_env; read by torch.distributed.elastic.
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
#: "0": rank 0 hosts the store itself. Set by the local engine (local/group.py); read by torch.distributed.
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: What spec.node_env adds to a node command's environment (beside RUN_ID and ATTEMPT).
NODE_VARS = (WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, NUM_NODES, MASTER_ADDR, MASTER_PORT)
#: What spec.rank_env adds to that for one rank (spec.rank_vars, also for the Slurm rank tasks).
RANK_VARS = (RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, TORCHELASTIC_RUN_ID)
#: torchrun's redirection of its workers' output. Set by node/ranklines.py for the command; read by torchrun.
PET_REDIRECTS = "PET_REDIRECTS"
#: torchrun's copy of its workers' output to its own. Set by the user; read by torchrun.
PET_TEE = "PET_TEE"
#: torchrun's folder of its workers' log files. Set by node/ranklines.py; read by torchrun.
PET_LOG_DIR = "PET_LOG_DIR"
#: torchrun's log settings; any of them set by the user turns the rank prefix off (node/ranklines.py).
TORCHRUN_LOG_VARS = (PET_REDIRECTS, PET_TEE, PET_LOG_DIR)

# launcher -> rank: set by gpufleet for the processes of a run.
#: Marks every process of a run. Set by spec.node_env and the supervisors; read by proctree, stacks,
#: leasing (gpu_processes) and the executors to find a run's processes.
RUN_ID = "GPUFLEET_RUN_ID"
#: The attempt number (1, 2, ...). Set by spec.node_env; read by user code.
ATTEMPT = "GPUFLEET_ATTEMPT"
#: The run's folder. Set by the engines' groups and workload/runner.py; read by progress, live, stacks, nodes.
RUN_DIR = "GPUFLEET_RUN_DIR"
#: The workload's checkpoint folder. Set by workload/runner.py; read by user code.
CHECKPOINT_DIR = "GPUFLEET_CHECKPOINT_DIR"
#: The caller's pid (a rank ends itself when its caller is gone). Set by the local and Ray engines; read by worker.py.
PARENT_PID = "GPUFLEET_PARENT_PID"
#: The file (JSON, written whole) with the part of a rank's environment that comes after the
#: start. Set by the local engine; read by worker.py, which waits for it and adds it to ``os.environ``.
LATE_ENV = "GPUFLEET_LATE_ENV"
#: "0" turns off the rendezvous store rank 0 hosts on the loopback interface. Set by ray_launch.py
#: (and the user); read by worker.py and the local engine.
LOOPBACK_STORE = "GPUFLEET_LOOPBACK_STORE"
#: "replace": a rank that dies is replaced in place (the launcher hosts the store; survivors wait
#: for its verdict). Set by api.py; read by launch/replace.py and the checkpoint manager.
RECOVERY = "GPUFLEET_RECOVERY"
#: How many warm spare processes the local group keeps ready to replace a dead rank. Set by api.py;
#: read by the local group (launch/engines/local/spares.py).
SPARES = "GPUFLEET_SPARES"
#: In a warm spare: its number (it has no rank until it takes a dead rank's). Set by the local group;
#: read by launch/worker.py.
SPARE = "GPUFLEET_SPARE"
#: The process group's generation (0, then one more after each replacement). Set by the local group
#: for a replacement and by launch/replace.py in a survivor; read by launch/replace.py.
GENERATION = "GPUFLEET_GENERATION"
#: Which process of its rank this is (1: the first; 2: its first replacement...). Set by the local
#: group; read by faults.py and launch/replace.py.
INCARNATION = "GPUFLEET_INCARNATION"
#: The faults (a JSON list) an attempt rehearses. Set by faults.py; read by faults.py, the node guard
#: and fault_boot/sitecustomize.py.
FAULTS = "GPUFLEET_FAULTS"
#: The file whose existence means "checkpoint now, the job ends soon". Set by the Slurm engine; read by
#: checkpoint/preemption.py and the node guard.
PREEMPT_FILE = "GPUFLEET_PREEMPT_FILE"
#: How often (seconds) a rank rewrites its progress file. Set by progress.py and live; read by progress.py,
#: the engines' groups and workload/nodes.py.
PROGRESS_S = "GPUFLEET_PROGRESS_S"
#: Names (comma-separated) of the environment variables that hold secrets. Set by secrets.py; read by
#: secrets.py and the node guard (which masks their values in the output).
SECRETS = "GPUFLEET_SECRETS"
#: The Ray node a rank runs on. Set by the Ray engine (ray/group.py); read by user code.
RAY_NODE_ID = "GPUFLEET_RAY_NODE_ID"
#: "1": the call's RAY_ADDRESS points at an existing cluster. Set and read by ray_launch.py (rank 0).
RAY_REMOTE = "GPUFLEET_RAY_REMOTE"
#: Where the workload's code runs from. Set by workload/runner.py and the Ray actor; read by user code and envs.
CODE_SOURCE_PATH = "CODE_SOURCE_PATH"
#: The workload's hyperparameters file. Set by workload/runner.py and the Ray executor; read by user code.
HYPERPARAMETERS_PATH = "HYPERPARAMETERS_PATH"

# supervisor/actor -> node: between gpufleet's own processes on a node.
#: A node command's dependencies (JSON list). Set by the Ray executor; read by the Ray actor and node/envs.py.
DEPENDENCIES = "GPUFLEET_DEPENDENCIES"
#: The bin folder of the run's environment. Set by the Ray executor; read by the Ray actor.
SUPERVISOR_BIN = "GPUFLEET_SUPERVISOR_BIN"
#: "1" when Ray ships the workload's code snapshot to the node. Set by the Ray executor; read by the Ray actor.
SHIPPED_CODE = "GPUFLEET_SHIPPED_CODE"
#: The node command. Set by the Ray actor; read by its bash that builds the run's environment on a node first.
NODE_COMMAND = "GPUFLEET_NODE_COMMAND"
#: The node's Python. Set by the Ray actor; read by that bash to run node/envs.py.
NODE_PYTHON = "GPUFLEET_NODE_PYTHON"
#: The path of node/envs.py. Set by the Ray actor; read by that bash.
ENVS_PY = "GPUFLEET_ENVS_PY"

# user settings: read by gpufleet, set by whoever runs it.
#: Where run folders, stores and node environments live (default ``~/.gpufleet``). Read by results.py,
#: private.py and node/envs.py.
HOME = "GPUFLEET_HOME"
#: "0" switches tracking off. Read by tracking/runs.py.
TRACKING = "GPUFLEET_TRACKING"
#: Seconds gpufleet waits for one tracking step. Read by tracking/bounds.py.
TRACKING_WAIT_S = "GPUFLEET_TRACKING_WAIT_S"
#: "0" switches the live view off everywhere. Read by live.
LIVE = "GPUFLEET_LIVE"
#: "1" keeps gpufleet's own frames in the traceback a rank sends back. Read by launch/tracebacks.py.
FULL_TRACEBACK = "GPUFLEET_FULL_TRACEBACK"
#: The hang watchdog's fast limit is never below this (seconds). Read by hangwatch/watchdog.py.
HANG_FLOOR_S = "GPUFLEET_HANG_FLOOR_S"
#: The hang watchdog's fast limit over the learned step time. Read by hangwatch/watchdog.py.
HANG_FACTOR = "GPUFLEET_HANG_FACTOR"
#: "0" switches the registry of calls off. Read by runs/calls.py.
REGISTRY = "GPUFLEET_REGISTRY"
#: Seconds a call waits for the registry's store. Read by runs/calls.py.
REGISTRY_WAIT_S = "GPUFLEET_REGISTRY_WAIT_S"
#: Seconds a CLI command waits for a locked run store. Read by runs/store.py.
STORE_WAIT_S = "GPUFLEET_STORE_WAIT_S"
#: Seconds a supervisor waits for a locked run store in one write. Read by runs/supervisor.py.
SUPERVISOR_STORE_WAIT_S = "GPUFLEET_SUPERVISOR_STORE_WAIT_S"
#: Most files in a workload's code snapshot. Read by workload/snapshot.py.
SNAPSHOT_MAX_FILES = "GPUFLEET_SNAPSHOT_MAX_FILES"
#: Most bytes in a workload's code snapshot. Read by workload/snapshot.py.
SNAPSHOT_MAX_BYTES = "GPUFLEET_SNAPSHOT_MAX_BYTES"
#: The folder of the GPU lease files. Read by launch/leasing.
LEASE_DIR = "GPUFLEET_LEASE_DIR"
#: "1" ignores other users' processes on the GPUs when leasing. Read by leasing/gpu_processes.py.
IGNORE_FOREIGN_GPU_PROCESSES = "GPUFLEET_IGNORE_FOREIGN_GPU_PROCESSES"
#: Memory (MiB) from which another user's process counts as using a GPU. Read by leasing/gpu_processes.py.
FOREIGN_GPU_MEMORY_MIB = "GPUFLEET_FOREIGN_GPU_MEMORY_MIB"
#: Utilization (%) from which another user's process counts as using a GPU. Read by leasing/gpu_processes.py.
FOREIGN_GPU_UTIL_PERCENT = "GPUFLEET_FOREIGN_GPU_UTIL_PERCENT"
#: "0" turns the rank prefix of a node's log lines off. Read by node/ranklines.py.
RANK_PREFIX = "GPUFLEET_RANK_PREFIX"

# test hooks: set by tests (and documented), read by gpufleet.
#: ``N`` gives this machine N fake GPUs, leased like real ones. Read by launch/gpus.py and leasing.
FAKE_GPUS = "GPUFLEET_FAKE_GPUS"
#: NVML's process list on fake GPUs (``"0=1234,1=5678:512:0"``). Read by leasing/gpu_processes.py.
FAKE_GPU_PROCESSES = "GPUFLEET_FAKE_GPU_PROCESSES"
