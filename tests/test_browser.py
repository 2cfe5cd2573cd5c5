"""The memory calculator of notebooks/02_memory.ipynb, in a real browser.

Starts JupyterLab on 127.0.0.1 (a free port, a random token, a copy of the notebook in the test's
temp dir, Jupyter's config and runtime dirs there too), opens the notebook in headless Chromium
(Debian's `chromium` + `chromium-driver`, driven by Selenium; nothing is downloaded at run time),
runs every cell from the Run menu, moves the calculator's K slider one step to the right with the
keyboard, and asserts that the rendered table changes to zerolab.theory's value for the new K and
that a new, non-blank plot is rendered with no traceback in the calculator's output (JupyterLab
runs widget callbacks on a kernel subshell thread: notebook 02 must draw thread-safely).
A screenshot goes to the test's temp dir (path printed).

Every wait is explicit, on one named condition, and fails naming what it awaited; all waits share
one budget (ZEROLAB_BROWSER_BUDGET seconds, default 120) and pytest-timeout backs it up. The
server is always shut down (its REST shutdown, then SIGTERM / SIGKILL of its process group, which
holds the kernel too). The "Select Kernel" dialog is turned off in the test's user settings.

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
from pathlib import Path

import pytest

from zerolab import theory
from zerolab.course.testing import free_port

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
    tracker.mkdir(parents=True)             # every cell in the DOM (no virtual scrolling),
    (tracker / "tracker.jupyterlab-settings").write_text(      # and no "Select Kernel" dialog
        '{"windowingMode": "none", "autoStartDefaultKernel": true}')
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


def _table_lines(psi, n, stage, k):
    """The two lines of the calculator's table that depend on K for `stage` (from theory)."""
    total = theory.model_state_total(psi, n, stage, optimizer_bytes=k)
    row = [line for line in theory.format_memory_table(psi, n, optimizer_bytes=k).splitlines()
           if line.startswith(theory.STAGE_NAMES[stage])][0]
    return " ".join(row.split()), f"K = {k:g}; chosen: {theory.STAGE_NAMES[stage]} -> {total / 1e9:.4g} GB per rank"


BUDGET = float(os.environ.get("ZEROLAB_BROWSER_BUDGET", 120))    # seconds, all waits together
INTERACT = "//div[contains(@class,'widget-interact')]"


class _Waiter:
    """Explicit waits on named conditions, sharing one deadline; a timeout fails the test with
    what was awaited, the seconds waited, and the tail of JupyterLab's log."""

    def __init__(self, driver, log: Path, budget: float):
        self.driver, self.log, self.deadline = driver, log, time.monotonic() + budget

    def __call__(self, what: str, condition, seconds: float | None = None, fail: bool = True):
        from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait
        left = self.deadline - time.monotonic()
        limit = max(0.5, min(left, seconds) if seconds is not None else left)
        start = time.monotonic()
        try:
            return WebDriverWait(self.driver, limit, poll_frequency=0.2,
                                 ignored_exceptions=(StaleElementReferenceException,)).until(condition)
        except TimeoutException:
            if not fail:
                return None
            pytest.fail(f"timed out after {time.monotonic() - start:.0f} s waiting for {what}\n"
                        f"JupyterLab log (tail):\n{self.log.read_text()[-1500:]}", pytrace=False)


def _accept_kernel_dialog(driver):
    """JupyterLab may ask which kernel to start ("Select Kernel"): take the proposed one."""
    from selenium.webdriver.common.by import By
    for button in driver.find_elements(
            By.XPATH, "//div[contains(@class,'jp-Dialog')]//button[.//*[normalize-space()='Select']"
                      " or normalize-space()='Select']"):
        button.click()


def _errors(driver) -> list[str]:
    """Tracebacks / error outputs shown anywhere in the calculator."""
    from selenium.webdriver.common.by import By
    texts = [e.text for e in driver.find_elements(
        By.XPATH, INTERACT + "//div[contains(@class,'jp-RenderedText')]")]
    return [t for t in texts if "Traceback" in t or "Error" in t or "Exception" in t]


def _plot_src(driver, exclude: str | None = None) -> str | None:
    """The data URL of a decoded plot image in the calculator's output (not `exclude`)."""
    return driver.execute_script(
        "const box = document.evaluate(arguments[0], document, null, 9, null).singleNodeValue;"
        "if (!box) return null;"
        "const img = [...box.querySelectorAll('.widget-output img')].find(i => i.complete"
        " && i.naturalWidth > 0 && i.getBoundingClientRect().height > 0 && i.src !== arguments[1]);"
        "return img ? img.src : null;", INTERACT, exclude or "")


def _ink(data_url: str) -> tuple[float, int]:
    """(fraction of non-white pixels, number of coloured pixels) of a PNG data URL."""
    import base64
    import io

    import matplotlib.image
    import numpy as np
    png = base64.b64decode(data_url.split(",", 1)[1])
    rgb = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    ink = (rgb < 0.9).any(axis=-1)
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25
    return float(ink.mean()), int(coloured.sum())


@pytest.mark.timeout(240)
def test_calculator_slider_changes_the_table_in_jupyterlab(jupyterlab, tmp_path):
    _require_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC

    base, token, log = jupyterlab
    driver = _driver(tmp_path)
    shot = tmp_path / "calculator.png"
    wait = _Waiter(driver, log, BUDGET)
    idle = (By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")
    k_xpath = "//div[contains(@class,'widget-hslider')][.//label[normalize-space()='K']]"
    output = INTERACT + "//div[contains(@class,'widget-output') or contains(@class,'jupyter-widget-output')]"

    def shows(lines):
        def check(drv):
            _accept_kernel_dialog(drv)
            if _errors(drv):        # fail at once, with the error, instead of timing out
                raise AssertionError("the calculator shows an error:\n" + _errors(drv)[0][-1500:])
            texts = [" ".join(e.text.split()) for e in drv.find_elements(By.XPATH, output)]
            return any(all(line in t for line in lines) for t in texts)
        return check

    try:
        driver.get(f"{base}/lab/tree/notebooks/{NOTEBOOK.name}?token={token}")
        wait("the notebook's cells to render", EC.presence_of_element_located(
            (By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")))

        def kernel_idle(drv):               # a kernel started (no dialog left open) and idle
            _accept_kernel_dialog(drv)
            names = [e.text for e in drv.find_elements(By.CSS_SELECTOR, ".jp-Toolbar-kernelName")]
            return (not drv.find_elements(By.CSS_SELECTOR, ".jp-Dialog") and drv.find_elements(*idle)
                    and any("Python" in name for name in names))
        wait("the kernel to start (toolbar: a Python kernel, no dialog, status idle)", kernel_idle)
        wait("the Run menu", EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']"))).click()
        wait("Run > Run All Cells", EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Run All Cells']"))
        ).click()
        # the calculator's K slider (ipywidgets 8: a noUiSlider handle, keyboard-operable)
        k_box = wait("the calculator's K slider (the last cell ran)",
                     EC.presence_of_element_located((By.XPATH, k_xpath)))
        # Ψ as the browser holds it: noUiSlider snaps a log slider's exponent to its step grid
        # (7.5e9 = 10^9.875 becomes 10^9.9 with step 0.05), and the kernel computes with that
        psi_handle = driver.find_element(
            By.XPATH, "//div[contains(@class,'widget-hslider')][.//label[normalize-space()='Ψ']]"
                      "//div[contains(@class,'noUi-handle')]")
        psi = 10 ** float(psi_handle.get_attribute("aria-valuenow"))
        before, after = _table_lines(psi, 64, 3, 12), _table_lines(psi, 64, 3, 13)
        assert before != after
        wait(f"the calculator's table for K = 12 ({before[1]!r})", shows(before))
        wait("every cell to finish (no [*] prompt) and the kernel to be idle", lambda drv: not any(
            "[*]" in e.text for e in drv.find_elements(By.CSS_SELECTOR, ".jp-InputPrompt"))
            and drv.find_elements(*idle))

        def new_plot(exclude=None):
            def check(drv):
                if _errors(drv):
                    raise AssertionError("the calculator's live plot raised:\n" + _errors(drv)[0][-1500:])
                return _plot_src(drv, exclude=exclude)
            return check
        old_plot = wait("the calculator's plot for K = 12 (a decoded image)", new_plot())

        k_box = driver.find_element(By.XPATH, k_xpath)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", k_box)

        def k_readout(drv) -> float:
            readout = k_xpath + "//div[contains(@class,'widget-readout')]"
            return float(drv.find_element(By.XPATH, readout).text)

        for _attempt in range(3):         # a key press lost to a re-render is pressed again
            if k_readout(driver) == 12.0:
                driver.find_element(By.XPATH, k_xpath + "//div[contains(@class,'noUi-handle')]"
                                    ).send_keys(Keys.ARROW_RIGHT)      # K: 12 -> 13 (step 1)
            if wait("the K slider's readout to leave 12", lambda drv: k_readout(drv) != 12.0, 5.0,
                    fail=False):
                break
        wait("the K slider's readout to show 13", lambda drv: k_readout(drv) == 13.0)
        wait(f"the calculator's table for K = 13 ({after[1]!r})", shows(after))
        plot = wait("a new plot image after the slider move (K = 13)", new_plot(exclude=old_plot))
        assert not _errors(driver), _errors(driver)[0][-1500:]
        ink, coloured = _ink(plot)
        print(f"calculator plot after the move: {len(plot) * 3 // 4:,}-byte PNG, "
              f"{ink:.1%} of pixels inked, {coloured:,} coloured")
        assert ink > 0.02 and coloured > 500, \
            f"the plot after the move is blank: {ink:.2%} of pixels inked, {coloured} coloured"
        box = driver.find_element(By.XPATH, INTERACT)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", box)
    finally:
        driver.save_screenshot(str(shot))
        (tmp_path / "page.html").write_text(driver.page_source)      # for a failed run
        driver.quit()
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
