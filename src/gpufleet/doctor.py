"""``gpufleet doctor``: what this machine offers gpufleet (Python, torch, CUDA, GPUs, NCCL, extras)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
from typing import Any

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


def _torch_report() -> dict[str, Any]:
    if _version("torch") is None:
        return {"status": WARN, "installed": False, "hint": "pip install 'gpufleet[torch]'"}
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
            **({"hint": f"pip install 'gpufleet[{extra}]'"} if missing else {}),
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
    checks.append((OK if home_ok else FAIL, f"state folder {home} {'is writable' if home_ok else 'is NOT writable (set GPUFLEET_HOME)'}"))
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
