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

from tests.workload.helpers import tiny_wheel

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
    env = {**_env(tmp_path, url), "PIP_NO_INDEX": "1", "GPUFLEET_INSTALLER": "pip"}
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
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1", "GPUFLEET_INSTALLER": "pip"}
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


# --- uv: the installer where it can be had (scripts/uv_args.py gives it pip's configuration) ---

UV_ARGS = REPO / "scripts" / "uv_args.py"


def _uv() -> str:
    """The uv scripts/test.sh installs next to the test interpreter (or one on PATH)."""
    import shutil

    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("no uv next to this interpreter nor on PATH (scripts/test.sh installs one)")
    return found


def _uv_args(tmp_path: Path, pip_conf: str, **env: str) -> list[str]:
    conf = tmp_path / "pip.conf"
    conf.write_text(pip_conf)
    # the machine's own site configuration (XDG_CONFIG_DIRS) left out; /etc/pip.conf may add a cert
    run_env = {**_env(tmp_path, "none"), "PIP_CONFIG_FILE": str(conf), "XDG_CONFIG_DIRS": str(tmp_path), **env}
    done = subprocess.run([sys.executable, str(UV_ARGS)], env=run_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_uv_gets_pip_s_indexes_find_links_and_constraints(tmp_path: Path) -> None:
    lines = _uv_args(tmp_path, "[global]\nextra-index-url = file:///a/simple file:///b/simple\nfind-links = /w\n"
                               "constraint = /c.txt\ncert = /ca.crt\ntimeout = 77\n")  # fmt: skip
    assert lines == ["--index-strategy", "unsafe-best-match", "--extra-index-url", "file:///a/simple",
                     "--extra-index-url", "file:///b/simple", "--find-links", "/w", "--constraint", "/c.txt",
                     "env:SSL_CERT_FILE=/ca.crt", "env:UV_HTTP_TIMEOUT=77"]  # fmt: skip


def test_pip_s_environment_variables_win_over_its_files_for_uv_too(tmp_path: Path) -> None:
    lines = _uv_args(tmp_path, "[global]\nindex-url = https://files.example/simple\n",
                     PIP_INDEX_URL="https://mirror.example/simple", PIP_NO_INDEX="1")
    assert lines[:5] == ["--index-strategy", "unsafe-best-match", "--index-url", "https://mirror.example/simple",
                         "--no-index"]  # fmt: skip
    assert all(line.startswith("env:") for line in lines[5:]), lines


def test_pip_install_with_uv_says_the_build_before_and_after(tmp_path: Path) -> None:
    uv = _uv()
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1", "GPUFLEET_UV": uv, "GPUFLEET_INSTALLER": "uv"}
    done = _bash(f"pip_install {sys.executable} {tmp_path}/uv.log --dry-run packaging", env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("==> torch: no NVIDIA GPU; GPUFLEET_TORCH_CPU_INDEX=none"), lines
    assert lines[1].startswith(f"==> installing with {uv} (uv "), lines
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert lines[-1] == f"==> torch {torch.__version__}: {build}, already installed (kept)", lines
    assert "--no-index" in (tmp_path / "uv.log").read_text()  # pip's setting reached uv


def test_pip_install_with_uv_failing_shows_uv_s_last_lines_and_its_exit_code(tmp_path: Path) -> None:
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1", "GPUFLEET_UV": _uv(), "GPUFLEET_INSTALLER": "uv"}
    done = _bash(f"pip_install {sys.executable} {tmp_path}/uv.log --dry-run no-such-package-gpufleet-test; echo not reached", env)
    assert done.returncode != 0 and "not reached" not in done.stdout
    assert "uv failed (exit code" in done.stderr and "no-such-package-gpufleet-test" in done.stderr


def test_gpufleet_installer_pip_installs_with_pip_even_with_uv_there(tmp_path: Path) -> None:
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1", "GPUFLEET_UV": _uv(), "GPUFLEET_INSTALLER": "pip"}
    done = _bash(f"pip_install {sys.executable} {tmp_path}/pip.log --dry-run packaging", env)
    assert done.returncode == 0 and "installing with" not in done.stdout, done.stdout + done.stderr
    assert "Requirement already satisfied: packaging" in (tmp_path / "pip.log").read_text()


def test_uv_installs_by_default_where_there_is_one(tmp_path: Path) -> None:
    uv = _uv()
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1", "GPUFLEET_UV": uv}
    done = _bash(f"pip_install {sys.executable} {tmp_path}/uv.log --dry-run packaging", env)
    assert done.returncode == 0 and f"installing with {uv} (uv " in done.stdout, done.stdout + done.stderr


def test_without_uv_pip_installs_and_nothing_fails(tmp_path: Path) -> None:
    """No GPUFLEET_UV, no uv on PATH (a PATH of one empty folder) nor next to the interpreter used:
    pip installs, as on a machine where uv cannot be had."""
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(tmp_path / "venv")],
                   check=True, timeout=120)  # fmt: skip
    env = {**_env(tmp_path, "none"), "PIP_NO_INDEX": "1"}
    done = _bash(f"pip_install {python} {tmp_path}/pip.log --dry-run packaging", env)
    assert done.returncode == 0 and "installing with" not in done.stdout, done.stdout + done.stderr
    assert "Requirement already satisfied: packaging" in (tmp_path / "pip.log").read_text()


def test_describe_reads_where_uv_took_torch_from_its_log(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_torch(site, "2.13.0+cpu", None)
    log = tmp_path / "uv.log"
    log.write_text("DEBUG Selecting: torch==2.12.0 [compatible] (torch-2.12.0-cp311-cp311-manylinux_2_28_x86_64.whl)\n"
                   "DEBUG Selecting: torch==2.13.0+cpu [compatible] (torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)\n")  # fmt: skip
    env = {**_env(tmp_path, "none"), "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, str(HELPER), "describe", "--uv-log", str(log)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.splitlines() == ["torch 2.13.0+cpu: CPU build, from torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]


# --- a pure wheel built for another Python (scripts/wheel_tags.py) ---

WHEEL_TAGS = REPO / "scripts" / "wheel_tags.py"
THIS_PY = f"py{sys.version_info.major}{sys.version_info.minor}"
OLDER_PY = f"py{sys.version_info.major}{sys.version_info.minor - 1}"


def _simple_index(root: Path, wheels: list[Path]) -> str:
    """A file:// simple index (PEP 503) that offers ``wheels`` for their project."""
    project = root / "simple" / wheels[0].name.split("-")[0]
    project.mkdir(parents=True)
    project.joinpath("index.html").write_text("".join(f'<a href="{w.as_uri()}">{w.name}</a>\n' for w in wheels))
    return (root / "simple").as_uri()


def test_wheel_tags_lists_only_wheels_built_for_other_pythons_only(tmp_path: Path) -> None:
    sys.path.insert(0, str(WHEEL_TAGS.parent))
    try:
        from wheel_tags import foreign_wheels
    finally:
        sys.path.pop(0)
    site = tmp_path / "site"
    for name, tags in {"old": ["py310"], "mine": ["py311"], "both": ["py310", "py311"], "any": ["py3"], "native": ["cp311-cp311-linux_x86_64"]}.items():  # fmt: skip
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        info.joinpath("WHEEL").write_text("Wheel-Version: 1.0\n" + "".join(
            f"Tag: {t}-none-any\n" if "-" not in t else f"Tag: {t}\n" for t in tags))  # fmt: skip
    assert foreign_wheels([str(site)], (3, 11)) == ["old==1.0"]
    assert foreign_wheels([str(site)], (3, 12)) == ["both==1.0", "mine==1.0", "old==1.0"]


def test_uv_taking_an_older_pythons_wheel_gets_this_pythons_from_pip(tmp_path: Path) -> None:
    """uv 0.13.9 takes a pure wheel for an older Python from the first index that has the version
    (multiprocess's py310 wheel on Python 3.11, which fails there); pip_install puts the one for
    this Python in its place and says so."""
    uv = _uv()
    older = _simple_index(tmp_path / "older", [tiny_wheel(tmp_path / "w-older", "gftag", OLDER_PY, tag=OLDER_PY)])
    both = _simple_index(tmp_path / "both", [tiny_wheel(tmp_path / "w-both", "gftag", OLDER_PY, tag=OLDER_PY), tiny_wheel(tmp_path / "w-both", "gftag", THIS_PY, tag=THIS_PY)])  # fmt: skip
    venv = tmp_path / "venv"
    (tmp_path / "no-links").mkdir()  # instead of the machine's find-links
    subprocess.run([uv, "venv", "--quiet", "--seed", "--python", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {**_env(tmp_path, "none"), "GPUFLEET_UV": uv, "GPUFLEET_INSTALLER": "uv", "PIP_INDEX_URL": both,
           "PIP_EXTRA_INDEX_URL": older, "PIP_FIND_LINKS": str(tmp_path / "no-links"), "PIP_CONSTRAINT": ""}  # fmt: skip
    done = _bash(f"pip_install {python} {tmp_path}/uv.log gftag", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gftag==0.1: a wheel for another Python; pip installs the one for this Python" in done.stdout, done.stdout
    tag = subprocess.run([str(python), "-c", "import gftag; print(gftag.VALUE)"], capture_output=True, text=True, timeout=60)
    assert tag.stdout.strip() == THIS_PY, tag.stdout + tag.stderr
