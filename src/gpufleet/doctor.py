"""``gpufleet doctor``: what this machine offers gpufleet (Python, torch, CUDA, GPUs, NCCL, extras)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from .launch.node import envcontract

#: extra -> the distributions it installs (import names differ; metadata names are used).
EXTRAS = {
    "torch": ["torch", "torchdata", "safetensors"],
    "deepspeed": ["deepspeed"],
    "ray": ["ray"],
    "mlflow": ["mlflow"],
    "hf": ["transformers", "trl", "peft", "accelerate", "datasets", "tokenizers"],
    "lightning": ["lightning"],
}

OK, WARN, FAIL = "ok", "warn", "fail"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def checkout_root() -> Path | None:
    """The source checkout this gpufleet runs from (an editable install, or ``src/`` on the path), or None."""
    root = Path(__file__).resolve().parent.parent.parent  # <checkout>/src/gpufleet/doctor.py
    try:
        project = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return root if re.search(r'(?m)^name\s*=\s*"gpufleet"', project) else None


def install_hint(extra: str) -> str:
    """How to install one of gpufleet's extras: from PyPI, or into the checkout this gpufleet runs from."""
    root = checkout_root()
    if root is None:
        return f"pip install 'gpufleet[{extra}]'"
    if root == Path.cwd().resolve():
        return f"pip install -e '.[{extra}]'"
    return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"


def _torch_report() -> dict[str, Any]:
    if _version("torch") is None:
        return {"status": WARN, "installed": False, "hint": install_hint("torch")}
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # a broken install
        return {"status": FAIL, "installed": True, "error": f"import torch failed: {e}"}
    info: dict[str, Any] = {
        "status": OK,
        "installed": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "gloo": bool(dist.is_available() and dist.is_gloo_available()),
        "nccl": bool(dist.is_available() and dist.is_nccl_available()),
    }
    if info["cuda_available"]:
        info["cuda_devices"] = torch.cuda.device_count()
        try:
            v = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # NCCL missing from this build
            info["nccl_version"] = None
            info["nccl_error"] = str(e)
        info["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    return info


#: Addresses a listening socket is reachable on only from this machine.
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _rendezvous_report() -> dict[str, Any] | None:
    """Where torch's rendezvous store listens when a run's rank 0 starts it, as for one machine.

    ``MASTER_ADDR=127.0.0.1`` only tells the other ranks where to connect: rank 0's
    ``TCPStore`` server binds its port on every interface. Probed by starting one on port 0.
    None without torch.distributed.
    """
    if _version("torch") is None:
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        if not dist.is_available():
            return None
        store = dist.TCPStore(
            host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
        try:
            address = _listen_address(store.port)
        finally:
            del store
    except Exception as e:
        return {"listen_address": None, "loopback_only": None, "error": str(e)}
    if address is None:
        return {"listen_address": None, "loopback_only": None, "error": "its listening socket was not found"}
    return {"listen_address": address, "loopback_only": address in _LOOPBACK}


def _listen_address(port: int) -> str | None:
    import psutil

    proc = psutil.Process()
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            return str(c.laddr.ip)
    return None


def _rendezvous_line(info: dict[str, Any]) -> tuple[str, str]:
    advice = ("with no authentication: on a shared network, firewall this host or run in a network "
              "namespace (docs/multinode.md, \"Rendezvous ports\")")  # fmt: skip
    address = info["listen_address"]
    if info["loopback_only"]:
        return OK, f"rendezvous: torch's TCPStore listens on {address} only (this machine)"
    if address is None:
        return WARN, f"rendezvous: could not check where torch's TCPStore listens ({info['error']}); it usually listens on all interfaces, {advice}"
    where = f"all interfaces ({address})" if address in ("::", "0.0.0.0") else address
    return WARN, (f"rendezvous: one-machine @distributed calls keep their store on 127.0.0.1, but torch's own "
                  f"TCPStore (a workload's torchrun, multi-node runs) listens on {where}, not only on "
                  f"MASTER_ADDR=127.0.0.1, {advice}")  # fmt: skip


def collect() -> dict[str, Any]:
    """Everything ``doctor`` reports, as a JSON-ready dict with ``ok``/``warn``/``fail`` checks."""
    from .launch.gpus import list_gpus
    from .results import gpufleet_home

    gpus = [
        {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_gib": round(g.memory_bytes / 2**30, 1)}
        for g in list_gpus()
    ]
    torch_info = _torch_report()
    extras = {}
    for extra, dists in EXTRAS.items():
        versions = {d: _version(d) for d in dists}
        missing = [d for d, v in versions.items() if v is None]
        extras[extra] = {
            "installed": not missing,
            "versions": versions,
            **({"hint": install_hint(extra)} if missing else {}),
        }
    home = gpufleet_home()
    home_ok = _writable(home)
    checks = []
    checks.append((OK if sys.version_info >= (3, 11) else FAIL, f"Python {platform.python_version()}"))
    checks.append((torch_info["status"], _torch_line(torch_info)))
    if gpus:
        names = sorted({g["name"] for g in gpus})
        checks.append((OK, f"{len(gpus)} GPU(s): {', '.join(names)}"))
        if torch_info.get("installed") and not torch_info.get("cuda_available", False):
            checks.append((WARN, "GPUs are present but torch cannot use CUDA (a CPU-only torch build?)"))
        elif torch_info.get("cuda_available") and not torch_info.get("nccl"):
            checks.append((WARN, "torch was built without NCCL: multi-GPU training falls back to gloo"))
    else:
        checks.append((WARN, "no NVIDIA GPU visible: use gpu_type='cpu' / accelerator_type CPU_<n> here"))
    rendezvous = _rendezvous_report() if torch_info.get("installed") and "error" not in torch_info else None
    if rendezvous is not None:
        checks.append(_rendezvous_line(rendezvous))
    checks.append((OK if home_ok else FAIL, f"state folder {home} {'is writable' if home_ok else f'is NOT writable (set {envcontract.HOME})'}"))
    for extra, info in extras.items():
        checks.append((OK if info["installed"] else WARN, f"extra [{extra}] " + (
            "installed" if info["installed"] else f"not installed ({info['hint']})")))  # fmt: skip
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "gpufleet": _version("gpufleet"),
        "torch": torch_info,
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "home": str(home),
        "rendezvous": rendezvous,
        "mlflow_tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
        "extras": extras,
        "checks": [{"status": s, "message": m} for s, m in checks],
    }


def _torch_line(info: dict[str, Any]) -> str:
    if not info.get("installed"):
        return f"torch not installed ({info['hint']})"
    if "error" in info:
        return info["error"]
    line = f"torch {info['version']} (CUDA build {info['cuda_build'] or 'none'}; gloo {'yes' if info['gloo'] else 'no'}, NCCL {'yes' if info['nccl'] else 'no'})"
    if info.get("nccl_version"):
        line += f", NCCL {info['nccl_version']}"
    return line


def _writable(path: Any) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".doctor-probe"
        probe.write_text("ok")
        probe.unlink()
        return True
    except OSError:
        return False


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when a check fails."""
    report = collect()
    if args.output == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        marks = {OK: "[ok]  ", WARN: "[warn]", FAIL: "[FAIL]"}
        for c in report["checks"]:
            print(f"{marks[c['status']]} {c['message']}")
    return 1 if any(c["status"] == FAIL for c in report["checks"]) else 0


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gpufleet doctor``."""
    p = subparsers.add_parser("doctor", help="report Python, torch, CUDA, GPUs, NCCL and installed extras")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(handler=cmd_doctor)
