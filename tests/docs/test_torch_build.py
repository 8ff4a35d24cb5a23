"""Which torch build the README's commands install (scripts/torch_build.py, scripts/pip_install.sh).

No network: PyTorch's CPU index is replaced (``GPUFLEET_TORCH_CPU_INDEX``) by a loopback server
that answers, a loopback port nobody listens on, or one that accepts and never answers; a GPU is an
``nvidia-smi`` script on PATH.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "torch_build.py"
LIB = REPO / "scripts" / "pip_install.sh"


@pytest.fixture
def index_server():
    """A loopback stand-in for the CPU index: answers every GET with a page, records the paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            body = b"<html><body><a href='torch-2.13.0+cpu.whl'>torch</a></body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu", asked
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connecting is refused


def _env(tmp_path: Path, index: str, gpu: str | None = None, **extra: str) -> dict[str, str]:
    """A PATH of one folder (with a fake nvidia-smi when ``gpu`` is its script), no proxies."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + gpu)
        fake.chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "GPUFLEET_TORCH_CPU_INDEX": index, **extra}


def _pip_args(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, str(HELPER), "pip-args"], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_without_a_gpu_a_reachable_cpu_index_is_added_to_the_resolve(tmp_path: Path, index_server) -> None:
    url, asked = index_server
    lines = _pip_args(_env(tmp_path, url))
    assert lines == [f"torch: no NVIDIA GPU: CPU builds of torch from {url}", "--extra-index-url", url]
    assert asked == ["/whl/cpu/torch/"]


def test_an_unreachable_cpu_index_falls_back_to_what_pip_finds_and_says_so(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    lines = _pip_args(_env(tmp_path, url))
    assert len(lines) == 1, lines  # no pip argument: pip's configured indexes and caches decide
    assert lines[0].startswith(f"torch: no NVIDIA GPU, but PyTorch's CPU index {url} cannot be reached (")
    assert "refused" in lines[0] and "pip takes torch from its configured indexes and caches" in lines[0]


def test_an_index_that_never_answers_is_given_up_after_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu"
        lines = _pip_args(_env(tmp_path, url, GPUFLEET_TORCH_INDEX_TIMEOUT="0.5"))
    assert len(lines) == 1 and "cannot be reached" in lines[0], lines


def test_with_an_nvidia_gpu_the_cpu_index_is_not_even_asked(tmp_path: Path, index_server) -> None:
    url, asked = index_server
    gpu = "echo 'GPU 0: NVIDIA H200 (UUID: GPU-5e1f)'\n"
    lines = _pip_args(_env(tmp_path, url, gpu=gpu))
    assert lines == ["torch: NVIDIA GPU found (GPU 0: NVIDIA H200 (UUID: GPU-5e1f)): pip takes torch from its "
                     "configured indexes (CUDA builds)"]  # fmt: skip
    assert asked == []


def test_an_nvidia_smi_that_fails_is_no_gpu(tmp_path: Path, index_server) -> None:
    url, _ = index_server
    lines = _pip_args(_env(tmp_path, url, gpu="echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n"))
    assert lines[1:] == ["--extra-index-url", url]


def test_a_bad_timeout_is_refused_with_what_to_write(tmp_path: Path) -> None:
    env = _env(tmp_path, f"http://127.0.0.1:{_closed_port()}", GPUFLEET_TORCH_INDEX_TIMEOUT="soon")
    done = subprocess.run([sys.executable, str(HELPER), "pip-args"], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0 and "GPUFLEET_TORCH_INDEX_TIMEOUT='soon' is not a number of seconds" in done.stderr


def _fake_torch(site: Path, version: str, cuda: str | None) -> None:
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('describe must not import torch')\n")
    (site / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = {version!r}\ncuda: Optional[str] = {cuda!r}\n"
    )
    dist = site / f"torch-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def _describe(tmp_path: Path, site: Path, report: dict | None) -> list[str]:
    args = [sys.executable, str(HELPER), "describe"]
    if report is not None:
        (tmp_path / "report.json").write_text(json.dumps(report))
        args += ["--pip-report", str(tmp_path / "report.json")]
    env = {**_env(tmp_path, "none"), "PYTHONPATH": str(site)}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_describe_names_version_build_and_where_pip_took_it(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_torch(site, "2.13.0+cpu", None)
    wheel = "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    report = {"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"}, "download_info": {"url": wheel}}]}
    assert _describe(tmp_path, site, report) == [
        "torch 2.13.0+cpu: CPU build, from /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    ]
    assert _describe(tmp_path, site, {"install": []}) == ["torch 2.13.0+cpu: CPU build, already installed (kept)"]


def test_describe_says_when_a_machine_without_gpu_got_a_cuda_build(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_torch(site, "2.14.1", "13.0")
    url = "https://files.pythonhosted.org/packages/ab/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    report = {"install": [{"metadata": {"name": "torch", "version": "2.14.1"}, "download_info": {"url": url}}]}
    lines = _describe(tmp_path, site, report)
    assert lines[0] == f"torch 2.14.1: CUDA 13.0 build, from {url}"
    assert lines[1].startswith("  (this machine has no NVIDIA GPU: this CUDA build runs on CPU")


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**env, "PATH": env["PATH"] + ":/usr/bin:/bin"}  # grep, sed, tee
    return subprocess.run(["bash", "-c", f"set -euo pipefail; . {LIB}\n{script}"], env=env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip


def test_pip_install_says_the_build_before_and_after_pip(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    env = {**_env(tmp_path, url), "PIP_NO_INDEX": "1"}
    # a dry run of a package already there: pip runs, changes nothing, and its report lists no install
    done = _bash(f"pip_install {sys.executable} {tmp_path}/pip.log --dry-run packaging", env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("==> torch: no NVIDIA GPU, but PyTorch's CPU index"), lines
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert f"==> torch {torch.__version__}: {build}, already installed (kept)" in lines, lines
    assert "Requirement already satisfied: packaging" in (tmp_path / "pip.log").read_text()


def test_pip_install_failing_shows_pip_s_last_lines_and_its_exit_code(tmp_path: Path) -> None:
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1"}
    done = _bash(f"pip_install {sys.executable} {tmp_path}/pip.log --dry-run no-such-package-gpufleet-test; echo not reached", env)
    assert done.returncode == 1 and "not reached" not in done.stdout
    assert "pip failed (exit code 1); its last lines (all of them in" in done.stderr
    assert "No matching distribution found for no-such-package-gpufleet-test" in done.stderr


def test_the_progress_shows_a_line_per_phase_and_a_heartbeat_while_pip_is_quiet(tmp_path: Path) -> None:
    pip_output = (
        "Collecting torch<2.14,>=2.6 (from gpufleet==0.1.0)\n"
        "WARNING: Location 'file:///x/simple/torch/' is ignored\n"
        "  Downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (190.2 MB)\n"
        "Requirement already satisfied: numpy in ./lib\n"
        "Installing collected packages: sympy, torch, gpufleet\n"
    )
    # two seconds without a line, then the end: at least one heartbeat at 0.5 s of quiet
    script = (f"{{ printf %s {shlex.quote(pip_output)}; sleep 2; echo 'Successfully installed sympy-1 torch-2 gpufleet-0.1'; }}"
              " | PIP_INSTALL_QUIET_S=0.5 _pip_progress")  # fmt: skip
    done = _bash(script, dict(os.environ))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        "    Collecting torch<2.14,>=2.6",
        "    Downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (190.2 MB)",
        "    installing 3 package(s) into the environment (torch takes a minute or more) ...",
    ], lines
    assert lines[3].startswith("    ... pip still working (") and lines[-1] == "    installed 3 package(s)", lines
