"""The memory calculator of notebooks/02_memory.ipynb, in a real browser.

Starts JupyterLab on 127.0.0.1 (a free port, a random token, a copy of the notebook in the test's
temp dir, Jupyter's config and runtime dirs there too), opens the notebook in headless Chromium
(Debian's `chromium` + `chromium-driver`, driven by Selenium; nothing is downloaded at run time),
runs every cell from the Run menu, moves the calculator's K slider one step to the right with the
keyboard, and asserts that the rendered table changes to zerolab.theory's value for the new K.
A screenshot goes to the test's temp dir (path printed). The server is always shut down (its
REST shutdown, then SIGTERM / SIGKILL of its process group, which holds the kernel too).

Skipped when Chromium, chromedriver, Selenium or JupyterLab is missing, unless
ZEROLAB_REQUIRE_BROWSER=1 (set by .ci/run, which installs them): then it fails instead.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from zerolab import theory
from zerolab.testing import free_port

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "02_memory.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _missing() -> str | None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "chromium / chromedriver not found (apt-get install chromium chromium-driver)"
    try:
        import jupyterlab  # noqa: F401
        import selenium  # noqa: F401
    except ImportError as err:
        return f"{err.name} is not installed (pip install -e '.[cpu,dev]')"
    return None


def _require_browser():
    why = _missing()
    if why is not None:
        if os.environ.get("ZEROLAB_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required but {why}", pytrace=False)
        pytest.skip(why)


def _get(url: str, timeout: float = 2.0, data: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


@pytest.fixture
def jupyterlab(tmp_path):
    """(base url, token, log path) of a JupyterLab server serving a copy of notebook 02."""
    work = tmp_path / "lab"                 # a copy of the course: JupyterLab autosaves
    for folder in ("notebooks", "images", "scripts"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("*.ipynb"))
    nb = json.loads(NOTEBOOK.read_text())
    nb["metadata"].pop("widgets", None)     # no saved widget views: only live ones count
    (work / "notebooks" / NOTEBOOK.name).write_text(json.dumps(nb))
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)                # no "official Jupyter news?" pop-up
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)             # every cell in the DOM (no virtual scrolling)
    (tracker / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}    # the kernel's inline
    env = dict(env, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--port-retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--allow-root"]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work,
                                  start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(f"{base}/api/status?token={token}") == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start:\n{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.3)
        yield base, token, log
    finally:
        try:
            _get(f"{base}/api/shutdown?token={token}", data=b"")
            server.wait(10)
        except Exception:  # noqa: BLE001 - fall through to signals
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):    # the server's group holds its kernels
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                break
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                continue
        assert server.poll() is not None


def _driver(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def _accept_kernel_dialog(driver, seconds=3.0):
    """JupyterLab may ask which kernel to start ("Select Kernel"): take the proposed one."""
    from selenium.webdriver.common.by import By
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        buttons = driver.find_elements(
            By.XPATH, "//div[contains(@class,'jp-Dialog')]//button[.//*[normalize-space()='Select']"
                      " or normalize-space()='Select']")
        if buttons:
            buttons[0].click()
            return
        time.sleep(0.2)


def _table_lines(psi, n, stage, k):
    """The two lines of the calculator's table that depend on K for `stage` (from theory)."""
    total = theory.model_state_total(psi, n, stage, optimizer_bytes=k)
    row = [line for line in theory.format_memory_table(psi, n, optimizer_bytes=k).splitlines()
           if line.startswith(theory.STAGE_NAMES[stage])][0]
    return " ".join(row.split()), f"K = {k:g}; chosen: {theory.STAGE_NAMES[stage]} -> {total / 1e9:.4g} GB per rank"


@pytest.mark.timeout(180)
def test_calculator_slider_changes_the_table_in_jupyterlab(jupyterlab, tmp_path):
    _require_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    base, token, log = jupyterlab
    driver = _driver(tmp_path)
    shot = tmp_path / "calculator.png"
    try:
        wait = WebDriverWait(driver, float(os.environ.get("ZEROLAB_BROWSER_WAIT", 90)))
        driver.get(f"{base}/lab/tree/notebooks/{NOTEBOOK.name}?token={token}")
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")))
        wait.until(EC.presence_of_element_located(
            (By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")))
        _accept_kernel_dialog(driver)
        # Run > Run All Cells
        wait.until(EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']"))).click()
        wait.until(EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Run All Cells']"))
        ).click()
        _accept_kernel_dialog(driver)
        # the calculator's K slider (ipywidgets 8: a noUiSlider handle, keyboard-operable)
        k_box = wait.until(EC.presence_of_element_located(
            (By.XPATH, "//div[contains(@class,'widget-hslider')][.//label[normalize-space()='K']]")))
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", k_box)
        # Ψ as the browser holds it: noUiSlider snaps a log slider's exponent to its step grid
        # (7.5e9 = 10^9.875 becomes 10^9.9 with step 0.05), and the kernel computes with that
        psi_handle = driver.find_element(
            By.XPATH, "//div[contains(@class,'widget-hslider')][.//label[normalize-space()='Ψ']]"
                      "//div[contains(@class,'noUi-handle')]")
        psi = 10 ** float(psi_handle.get_attribute("aria-valuenow"))
        before = _table_lines(psi, 64, 3, 12)
        output = ("//div[contains(@class,'widget-output') or contains(@class,'jupyter-widget-output')]")

        def shows(lines):
            def check(drv):
                texts = [" ".join(e.text.split()) for e in drv.find_elements(By.XPATH, output)]
                return any(all(line in t for line in lines) for t in texts)
            return check

        wait.until(shows(before))
        wait.until(lambda drv: not any("[*]" in e.text for e in drv.find_elements(
            By.CSS_SELECTOR, ".jp-InputPrompt")))           # every cell has run
        wait.until(EC.presence_of_element_located(
            (By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")))
        handle = k_box.find_element(By.CSS_SELECTOR, ".noUi-handle")
        handle.send_keys(Keys.ARROW_RIGHT)                        # K: 12 -> 13 (step 1)
        after = _table_lines(psi, 64, 3, 13)
        WebDriverWait(driver, 30).until(shows(after))
        readout = k_box.find_element(By.CSS_SELECTOR, ".widget-readout").text
        assert float(readout) == 13.0
        assert before != after
        # the screenshot: the whole calculator once the kernel has redrawn the plot
        wait.until(EC.presence_of_element_located(
            (By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")))
        box = driver.find_element(By.CSS_SELECTOR, ".widget-interact")
        # the plot is not what this test asserts (the table is), but a broken one is reported:
        # on the merged tree of 2026-11-29 the live update's tight_layout sometimes raises
        # matplotlib's mathtext ParseException or draws a blank figure (notebook 02's owner told)
        error = [e.text for e in box.find_elements(By.CSS_SELECTOR, ".jp-RenderedText")
                 if "Traceback" in e.text]
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", box)
        if error:
            warnings.warn("notebook 02's calculator raised while redrawing the plot in "
                          "JupyterLab: " + error[0].strip().splitlines()[-1][:300])
        else:
            wait.until(lambda drv: drv.execute_script(
                "return [...arguments[0].querySelectorAll('.widget-output img')]"
                ".some(i => i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().height > 0)",
                box))
            time.sleep(1.0)                 # let the browser paint the decoded plot
            src = box.find_element(By.CSS_SELECTOR, ".widget-output img").get_attribute("src")
            print(f"calculator plot after the move: a {len(src) * 3 // 4:,}-byte PNG")
    finally:
        driver.save_screenshot(str(shot))
        (tmp_path / "page.html").write_text(driver.page_source)      # for a failed run
        driver.quit()
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
