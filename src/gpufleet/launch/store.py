"""The run's rendezvous store on the loopback interface, and the notices it carries to the ranks.

torch's own store server listens on every interface, unauthenticated. gpufleet hosts it on
``127.0.0.1`` from a listener it binds itself, and every rank (the host included) is a client, as
under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE=True``). Who hosts it:

- rank 0, for a one-machine call (``worker.py``), as before any recovery existed;
- the launcher itself, for a call with ``recovery="replace"``: a rank that dies takes nothing of
  the rendezvous with it, so any rank, rank 0 included, can be replaced in place.

The launcher tells the ranks what it decided about a dead peer through one key per generation of
the process group, ``gpufleet/notice/{generation}``; the replacement tells the launcher that it
is back (the step every rank went on from, when it completed the next one) through
``gpufleet/recovered/{generation}``. Both are small JSON, parsed strictly (any local user can
reach a loopback port, so nothing pickled ever crosses the store). A warm spare learns which
rank it takes through ``gpufleet/spare/{number}`` (:class:`Assignment`).
"""

from __future__ import annotations

import datetime
import json
import socket
from dataclasses import asdict, dataclass
from typing import Any

from .node import envcontract

__all__ = ["NOTICE_PREFIX", "Assignment", "Notice", "Recovered", "generation_prefix", "host", "notice_key",
           "recovered_key", "spare_key"]

#: Where the launcher posts its verdict about generation g's dead peer.
NOTICE_PREFIX = "gpufleet/notice/"
#: Where the replacement that joined generation g says it is back.
RECOVERED_PREFIX = "gpufleet/recovered/"
#: Where warm spare n learns which rank it takes.
SPARE_PREFIX = "gpufleet/spare/"
#: What a store lives for (the ranks' own collectives have their own timeout).
STORE_TIMEOUT = datetime.timedelta(minutes=30)


def notice_key(generation: int) -> str:
    return f"{NOTICE_PREFIX}{generation}"


def recovered_key(generation: int) -> str:
    return f"{RECOVERED_PREFIX}{generation}"


def spare_key(number: int) -> str:
    return f"{SPARE_PREFIX}{number}"


def generation_prefix(generation: int) -> str:
    """The store prefix of generation ``generation`` >= 1 of the process group (generation 0 is torch's own)."""
    return f"gpufleet/g{generation}/"


@dataclass(frozen=True)
class Notice:
    """The launcher's verdict on a dead rank of generation ``generation``.

    ``action`` is ``"replace"`` (a new process takes rank ``rank``; every rank goes on in
    generation ``generation + 1``) or ``"stop"`` (the attempt ends: the ranks report their errors).
    """

    action: str
    generation: int
    rank: int
    cause: str
    #: Why it is not replaced (``stop``), in words.
    reason: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> Notice:
        """A notice read back from the store; ValueError for anything but what :meth:`to_bytes` writes."""
        fields = _fields(data, "notice", ints=("generation", "rank"), texts=("action", "cause", "reason"))
        if fields["action"] not in ("replace", "stop"):
            raise ValueError(f"unknown notice action {fields['action']!r}")
        return cls(**fields)


@dataclass(frozen=True)
class Recovered:
    """The replacement's word that rank ``rank`` is back in generation ``generation``: every rank went
    on from ``resumed_step`` (``steps_lost`` steps that some rank had completed are trained again),
    and it completed the next step at ``at`` (seconds since the epoch)."""

    generation: int
    rank: int
    resumed_step: int
    steps_lost: int
    at: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> Recovered:
        """A report read back from the store; ValueError for anything but what :meth:`to_bytes` writes."""
        return cls(**_fields(data, "recovery report", ints=("generation", "rank", "resumed_step", "steps_lost"),
                             numbers=("at",)))  # fmt: skip


@dataclass(frozen=True)
class Assignment:
    """The launcher's word to a warm spare: take rank ``rank`` as its process number ``incarnation``
    in generation ``generation``, with ``env``, that rank's own variables (``envcontract.RANK_VARS``)."""

    rank: int
    generation: int
    incarnation: int
    env: dict[str, str]

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> Assignment:
        """An assignment read back from the store; ValueError for anything but what :meth:`to_bytes` writes
        (``env`` names only a rank's own variables)."""
        fields = _fields(data, "spare assignment", ints=("rank", "generation", "incarnation"), objects=("env",))
        env = fields["env"]
        if set(env) - set(envcontract.RANK_VARS) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"a spare assignment's env holds a rank's own variables, as text: {data[:200]!r}")
        return cls(**fields)


def _fields(data: bytes, what: str, ints: tuple[str, ...] = (), texts: tuple[str, ...] = (),
            numbers: tuple[str, ...] = (), objects: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """The JSON object in ``data`` with exactly these keys, each of its type; ValueError for anything else."""
    try:
        fields = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a gpufleet {what}: {data[:200]!r}") from e
    if not isinstance(fields, dict) or set(fields) != {*ints, *texts, *numbers, *objects}:
        raise ValueError(f"not a gpufleet {what}: {data[:200]!r}")
    for key in ints + numbers:
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int if key in ints else (int, float)):
            raise ValueError(f"a {what}'s {key} is a number: {data[:200]!r}")
    if not all(isinstance(fields[k], str) for k in texts):
        raise ValueError(f"a {what}'s {', '.join(texts)} are text: {data[:200]!r}")
    if not all(isinstance(fields[k], dict) for k in objects):
        raise ValueError(f"a {what}'s {', '.join(objects)} are objects: {data[:200]!r}")
    return fields


def host(port: int, world_size: int) -> Any:
    """Host a ``TCPStore`` on ``127.0.0.1:port`` in this process, from a listener bound here; the store.

    The server runs in torch's own thread and keeps serving while this process lives (or until
    the returned object is dropped).
    """
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
    except BaseException:
        listener.close()
        raise
    return TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                    timeout=STORE_TIMEOUT, master_listen_fd=listener.detach())  # fmt: skip


def client(port: int, timeout_s: float) -> Any:
    """A client of the loopback store on ``port``."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
