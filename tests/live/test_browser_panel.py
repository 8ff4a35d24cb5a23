"""The live panel in a real browser: JupyterLab on a loopback port, headless Chromium driven by Selenium.

A cell runs a 2-rank CPU function (a step every 0.2 s) until the test has seen what it checks; the
page itself must show the panel with two ranks, a step count that grows between two reads, a plot
with points, and the summary at the end. Screenshots go to the test's folder (and to ``$GPUFLEET_SCREENSHOT_DIR`` when set: the
README's picture is made that way). Skipped, with the reason, where Chromium, its driver,
JupyterLab or Selenium cannot be had (``scripts/setup_browser.sh`` installs the browser).
JupyterLab, its kernel (and the ranks) and Chromium are stopped at the end, and checked gone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

CELL = """
import os, time
os.environ["GPUFLEET_TRACKING"] = "0"
from gpufleet import distributed, runtime
from gpufleet.tracking import log_metrics

STOP = os.environ["PANEL_TEST_STOP"]  # the test makes it once the page showed the steps growing

@distributed(gpus=2, gpu_type="cpu", keep_warm=False)
def train(steps=600):
    import math, time
    import torch, torch.distributed as dist
    runtime.setup()
    runtime.set_total_steps(steps)
    for step in range(1, steps + 1):
        time.sleep(0.2)
        stop = torch.tensor([float(os.path.exists(STOP))])
        dist.all_reduce(stop)  # the ranks go in step, as under DDP, and stop at the same step
        runtime.report_step(step)
        log_metrics({"loss": 2.0 * math.exp(-step / 25) + 0.05 * math.sin(step)}, step=step)
        if step % 15 == 0:
            print(f"epoch {step // 15}: step {step}", flush=True)
        if stop.item() > 0:
            break
    return step

train.distributed()
"""


def _need(what: str, found: object) -> None:
    if not found:
        pytest.skip(f"{what} is not available here (scripts/setup_browser.sh installs the browser)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"JupyterLab did not answer on {url} within {deadline_s:.0f} s")


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop_tree(procs: list[psutil.Process]) -> list[psutil.Process]:
    """TERM every process, then KILL what is left; returns those still alive after that."""
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    return alive


def _panel_shot(driver, path: Path) -> None:
    """A screenshot of the panel alone (it is replaced at each refresh: try again on a stale element)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(10):
        try:
            driver.find_element("css selector", "[data-gpufleet-panel]").screenshot(str(path))
            return
        except StaleElementReferenceException:
            time.sleep(0.05)


PANEL_JS = """
const panel = document.querySelector('[data-gpufleet-panel]');
if (!panel) return null;
const rows = panel.querySelectorAll('tr[data-rank]');
const plot = panel.querySelector('[data-gpufleet-plot]');
return {state: panel.getAttribute('data-state'), ranks: rows.length,
        steps: Array.from(rows).map(r => parseInt(r.getAttribute('data-step'))),
        points: plot ? parseInt(plot.getAttribute('data-points')) : 0,
        summary: !!panel.querySelector('[data-gpufleet-summary]'),
        text: panel.innerText};
"""


@pytest.mark.slow
def test_live_panel_in_jupyterlab_and_chromium(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    _need("Chromium", chromium)
    _need("chromedriver", driver_bin)
    try:
        import jupyterlab  # noqa: F401
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.skip(f"{e.name} is not installed (pip install -e '.[test]')")

    work = tmp_path / "lab"
    work.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, work / "live.ipynb")
    shots = [Path(p) for p in (tmp_path, os.environ.get("GPUFLEET_SCREENSHOT_DIR")) if p]

    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "jcfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "jrt"),
           "JUPYTER_DATA_DIR": str(tmp_path / "jdata"), "IPYTHONDIR": str(tmp_path / "ipy"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "jsettings"),
           "PANEL_TEST_STOP": str(tmp_path / "stop")}  # fmt: skip
    news = tmp_path / "jsettings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))  # no news toast over the screenshot
    lab = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate", "--ServerApp.terminals_enabled=False",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=work, env=env, stdout=open(tmp_path / "lab.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    driver = None
    service = None
    browser_pids: list[psutil.Process] = []
    try:
        began = time.monotonic()
        _wait_http(f"{base}/api/status?token={token}", 60, lab)
        print(f"JupyterLab answered after {time.monotonic() - began:.1f} s")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}",
                     "--window-size=1400,1000"):  # fmt: skip
            options.add_argument(flag)
        service = Service(executable_path=driver_bin, log_output=str(tmp_path / "chromedriver.log"))
        driver = webdriver.Chrome(service=service, options=options)
        browser_pids = _tree(service.process.pid)
        driver.set_script_timeout(30)
        driver.get(f"{base}/lab/tree/live.ipynb?token={token}")

        def until(what: str, check, deadline_s: float, every_s: float = 0.25):
            deadline = time.monotonic() + deadline_s
            while time.monotonic() < deadline:
                value = check()
                if value:
                    return value
                time.sleep(every_s)
            raise AssertionError(f"the page never showed {what} within {deadline_s:.0f} s")

        ready = ("const app = window.jupyterapp; if (!app) return false;"
                 "const w = app.shell.currentWidget; return !!(w && w.sessionContext && w.sessionContext.session"
                 " && w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle');")  # fmt: skip
        until("the notebook with an idle kernel", lambda: driver.execute_script(ready), 60)
        print(f"notebook and kernel ready after {time.monotonic() - began:.1f} s")
        driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")

        def running_panel():
            p = driver.execute_script(PANEL_JS)
            return p if p and p["ranks"] == 2 and min(p["steps"]) > 0 and p["points"] > 0 else None

        def summary():
            p = driver.execute_script(PANEL_JS)
            return p if p and p["summary"] else None

        first = until("the panel with two running ranks", running_panel, 60)
        print(f"panel running after {time.monotonic() - began:.1f} s: {first['steps']}")

        def grown_panel():  # the steps grow while it runs (however long a loaded machine takes per update)
            p = driver.execute_script(PANEL_JS)
            return p if p and min(p["steps"]) > min(first["steps"]) else None

        second = until("the steps growing", grown_panel, 60)
        assert second["ranks"] == 2, second
        assert second["points"] > 0 and second["state"] == "RUNNING", (first, second)
        for folder in shots:
            folder.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(folder / "live-running-page.png"))
            _panel_shot(driver, folder / "live-panel-running.png")
            driver.find_element("css selector", ".jp-Notebook .jp-CodeCell").screenshot(str(folder / "live-cell-running.png"))

        (tmp_path / "stop").touch()  # the run ends at its next step: the page shows its summary
        done = until("the summary", summary, 60, 0.5)
        print(f"summary after {time.monotonic() - began:.1f} s")
        assert done["state"] == "SUCCESS" and done["ranks"] == 2, done
        assert "2 ranks" in done["text"] and "final loss" in done["text"]
        for folder in shots:
            driver.save_screenshot(str(folder / "live-summary-page.png"))
            _panel_shot(driver, folder / "live-panel-summary.png")

        sessions = json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10))
        for s in sessions:  # the kernel goes first, then the server (it would ask the kernel to stop too)
            request = urllib.request.Request(f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE")
            urllib.request.urlopen(request, timeout=20)
    finally:
        lab_tree = _tree(lab.pid)
        if service is not None and service.process is not None:
            browser_pids = _tree(service.process.pid)
        if driver is not None:
            try:
                driver.quit()
            except Exception:  # noqa: BLE001 - the processes are stopped below in any case
                pass
        left = _stop_tree([*browser_pids, *lab_tree])
        if lab.poll() is None:
            lab.wait(10)
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], left
