"""Inside a rank of a call with ``recovery="replace"``: the process group's generations, and what a
surviving rank does when a peer dies.

When a rank's process dies, the collective its peers are in fails (gloo: "Connection closed by
peer"); the error unwinds the user's function into :func:`gpufleet.launch.worker.run_call`. There,
:func:`verdict_after` tells a peer's death (an error of the kind :func:`failures.is_secondary`
knows) from the rank's own error, which is reported as always, and waits for the launcher's
verdict in the store (:class:`gpufleet.launch.store.Notice`). On ``replace`` the survivor leaves the
broken group (:func:`next_generation`) and calls the function again in the same process: same pid,
same imports and memory; ``runtime.setup()`` then joins generation g+1 of the group over a fresh
store prefix (:func:`init_arguments`) beside the replacement, and ``CheckpointManager.resume()``
hands every rank the state of the last step all of them completed
(:mod:`gpufleet.checkpoint.in_memory`).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from .. import faults, runtime
from . import progress, store
from .failures import is_secondary
from .node import envcontract

__all__ = ["enabled", "forget", "group_sockets", "generation", "init_arguments", "next_generation", "report_back",
           "take_rank", "verdict_after"]

#: How long a survivor waits for the launcher's verdict (the launcher sees a death within a poll).
VERDICT_WAIT_S = 60.0
#: How long a rank waits for the others to join a new generation (a cold replacement imports torch first).
JOIN_TIMEOUT_S = 300.0


def enabled() -> bool:
    """Whether this rank's call replaces a dead rank in place."""
    return os.environ.get(envcontract.RECOVERY) == "replace"


def generation() -> int:
    """The process group's generation in this rank: 0 at the start, one more after each replacement."""
    return int(os.environ.get(envcontract.GENERATION) or 0)


def _store_port() -> int:
    return runtime.required_int(envcontract.MASTER_PORT)


def verdict_after(exc: BaseException) -> store.Notice | None:
    """The launcher's verdict when ``exc`` shows that a peer died; None when ``exc`` is this rank's
    own error (or the call does not replace ranks), which is then reported as it is.

    A verdict that does not come within :data:`VERDICT_WAIT_S` is a ``stop``.
    """
    if not enabled() or not isinstance(exc, Exception) or not is_secondary(type(exc).__name__, str(exc)):
        return None
    key = store.notice_key(generation())
    try:
        client = store.client(_store_port(), VERDICT_WAIT_S)
        client.wait([key], datetime.timedelta(seconds=VERDICT_WAIT_S))
        return store.Notice.parse(client.get(key))
    except Exception as e:  # noqa: BLE001 - no verdict: the rank reports its error as usual
        print(f"gpufleet: rank {runtime.rank_text()} got no verdict on its lost peer ({type(e).__name__}: {e}); "
              "reporting its error", file=sys.stderr, flush=True)  # fmt: skip
        return None


def forget(exc: BaseException) -> None:
    """Drop the frames of ``exc`` and of the errors it chains to (their locals: the old model, its group)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        error = error.__cause__ or error.__context__


_group_sockets: dict[int, str] = {}  # fd -> "socket:[inode]": the connections the group's init opened


def _sockets() -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing is remembered, and nothing shut
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


@contextlib.contextmanager
def group_sockets() -> Iterator[None]:
    """Around ``init_process_group`` (``runtime.setup``): remember the connections it opens."""
    if not enabled():
        yield
        return
    before = _sockets()
    yield
    _group_sockets.clear()
    _group_sockets.update({fd: t for fd, t in _sockets().items() if before.get(fd) != t})


def _shut_group_sockets() -> None:
    """Shut down the old group's connections to its peers (never the store's).

    torch's gloo keeps them open after ``destroy_process_group()`` (and after ``abort()``) while
    anything still refers to the group, so a survivor that is not connected to the dead rank would
    wait in its collective until the group's timeout; once its neighbours' ends are shut, it gets
    "Connection closed by peer" within milliseconds and comes here too.
    """
    port = _store_port()
    for fd, target in list(_group_sockets.items()):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                continue  # closed, and the number reused since
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] != port:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # a listening socket, or one already closed by its peer
            pass
        finally:
            sock.close()  # the duplicate only; gloo closes its own
    _group_sockets.clear()


def next_generation(notice: store.Notice) -> None:
    """Leave the broken process group and move this process to generation ``notice.generation + 1``.

    Call it outside the ``except`` block that caught the error, with its traceback dropped: a
    frame still holding the old DDP model or the group keeps its connections open.
    """
    _shut_group_sockets()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group broken by the lost peer; it goes with the process's next group
            pass
    gc.collect()  # the old model's wrapper, its reducer and its buckets, before the next generation allocates
    progress.reset()  # the function runs again: its steps (the live view's, the faults') count from its resume
    faults.restart_count()
    os.environ[envcontract.GENERATION] = str(notice.generation + 1)


def init_arguments() -> dict[str, Any] | None:
    """What ``init_process_group`` needs to join this rank's generation (None in generation 0, where
    torch's ``env://`` does it): a client of the launcher's store under the generation's prefix, the
    rank and the world size."""
    g = generation()
    if g == 0:
        return None
    from torch.distributed import PrefixStore

    client = store.client(_store_port(), JOIN_TIMEOUT_S)
    return {
        "store": PrefixStore(store.generation_prefix(g), client),
        "rank": runtime.get_global_rank(),
        "world_size": runtime.get_world_size(),
    }


def report_back(resumed_step: int, steps_lost: int) -> None:
    """In the replacement, once it completed its first step after the join: tell the launcher it is back
    (:class:`gpufleet.launch.store.Recovered`, which the run's records keep). Never fails the step."""
    import time

    g = generation()
    report = store.Recovered(g, runtime.get_global_rank(), resumed_step, steps_lost, time.time())
    try:
        client = store.client(_store_port(), 10.0)
        client.set(store.recovered_key(g), report.to_bytes())
    except Exception as e:  # noqa: BLE001 - the launcher then records the recovery without its numbers
        print(f"gpufleet: rank {runtime.rank_text()} could not report its recovery ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)  # fmt: skip


def take_rank(spare: int) -> int | None:
    """In warm spare number ``spare`` (imports done, the call loaded): wait until the launcher gives it a
    dead rank's place, take that rank's variables, generation and incarnation, and return the rank.
    None when the launcher's store is gone (the run ended without needing it): the spare exits."""
    key = store.spare_key(spare)
    try:
        client = store.client(_store_port(), VERDICT_WAIT_S)
        while True:
            try:
                client.wait([key], datetime.timedelta(seconds=VERDICT_WAIT_S))
                break
            except Exception as e:  # noqa: BLE001 - a wait's timeout: the run goes on without needing a spare
                if "timeout" not in str(e).lower():
                    raise
        assignment = store.Assignment.parse(client.get(key))
    except Exception:  # noqa: BLE001 - the store closed with its run (or never answered): nothing to take
        return None
    os.environ.update(assignment.env)
    os.environ[envcontract.GENERATION] = str(assignment.generation)
    os.environ[envcontract.INCARNATION] = str(assignment.incarnation)
    os.environ.pop(envcontract.SPARE, None)
    print(f"gpufleet: warm spare {spare} (pid {os.getpid()}) takes rank {assignment.rank}", file=sys.stderr, flush=True)
    return assignment.rank
