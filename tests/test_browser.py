"""The course as a learner opens it: README's command, notebook 02's figures and its calculator,
in a real browser.

Starts JupyterLab with the command README.md tells a learner to type (parsed from README.md, so a
change of the documented command is what is tested; docs/workshop.md must quote the same one),
run from a copy of the repository as the working directory, plus only the flags a test needs to
stay apart from the machine: 127.0.0.1, a free port, a random token, no browser, and Jupyter's
config, runtime, settings and workspace dirs in the test's temp dir. The server's root must be the
repository's root (README.md, docs/, labs/, images/ and notebooks/ are listed). In headless
Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium; nothing is downloaded at
run time) the test opens the URL the command would open in the learner's browser (notebook 01),
opens notebook 02 from JupyterLab's file browser, runs every cell from the Run menu and checks:
- every figure of 02 from `images/` (`../images/*.png`) is loaded and decoded (naturalWidth > 0);
- the calculator opens at exactly Ψ = 7.5e9 and shows zerolab.theory's table for it; Ψ typed as
  `70B` and then `7.5e9` (Enter) gives theory's tables for exactly those values, whose totals at
  N = 64 round to the ZeRO paper's 120 / 31.4 / 16.6 / 1.9 GB (computed here from theory);
- moving the K slider one step to the right with the keyboard changes the table to theory's
  value for the new K and renders a new, non-blank plot, with no traceback in the calculator's
  output (JupyterLab runs widget callbacks on a kernel subshell thread: 02 must draw
  thread-safely).
A screenshot goes to the test's temp dir (path printed).

Every wait is explicit, on one named condition, and fails naming what it awaited; all waits share
one budget (ZEROLAB_BROWSER_BUDGET seconds, default 150) and pytest-timeout backs it up. The
server is always shut down (its REST shutdown, then SIGTERM / SIGKILL of its process group, which
holds the kernels too). The "Select Kernel" dialog is turned off in the test's user settings.

Skipped when Chromium, chromedriver, Selenium or JupyterLab is missing, unless
ZEROLAB_REQUIRE_BROWSER=1 (set by .ci/run, which installs them): then it fails instead.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
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
README = ROOT / "README.md"
WORKSHOP = ROOT / "docs" / "workshop.md"
NOTEBOOK = ROOT / "notebooks" / "02_memory.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# what a learner sees at the server's root; the notebooks' `../images/*.png` need images/ there
COURSE_ROOT = {"README.md", "docs", "labs", "images", "notebooks"}


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


def readme_command() -> list[str]:
    """README's command that opens the course (`jupyter lab ...` in backticks), as words; every
    such command quoted in README.md and docs/workshop.md must be that one."""
    quoted = {}
    for doc in (README, WORKSHOP):
        for m in re.finditer(r"`(jupyter lab\b[^`]*)`", doc.read_text()):
            quoted.setdefault(" ".join(m.group(1).split()), set()).add(doc.name)
    first = re.search(r"`(jupyter lab\b[^`]*)`", README.read_text())
    assert first, "README.md quotes no `jupyter lab ...` command to open the course"
    assert len(quoted) == 1, f"README.md and docs/workshop.md quote different commands: {quoted}"
    return shlex.split(first.group(1))


def test_readme_command_is_quoted_once():
    """README.md and docs/workshop.md quote one command, and it runs JupyterLab."""
    assert readme_command()[:2] == ["jupyter", "lab"]


@pytest.fixture
def jupyterlab(tmp_path):
    """(base url, token, log path, runtime dir) of JupyterLab started with README's command in a
    copy of the repository."""
    _require_browser()
    words = readme_command()
    assert words[:2] == ["jupyter", "lab"], words
    work = tmp_path / "zerolab"             # a copy of the course: JupyterLab autosaves
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(
        ".git", "runs", "out", "wheelhouse", "build", ".venv", "__pycache__", "*.egg-info",
        ".*_cache", ".ipynb_checkpoints"))
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
    runtime = tmp_path / "runtime"
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}    # the kernel's inline
    env = dict(env, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(runtime),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # the test's own flags keep it apart from the machine; none of them may choose the root
    isolation = ["--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
                 f"--IdentityProvider.token={token}",
                 f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
                 f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--allow-root"]
    assert not any(re.search(r"root.dir|notebook.dir|preferred.dir", f) for f in isolation)
    # `jupyter lab` is this Python's JupyterLab; README's own words come last, as typed
    cmd = [sys.executable, "-m", "jupyterlab", *isolation, *words[2:]]
    log = tmp_path / "jupyterlab.log"
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
                pytest.fail(f"JupyterLab did not start ({shlex.join(words)}):\n"
                            f"{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.3)
        yield base, token, log, runtime
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
    """Every line of the calculator's table for these values (from theory), spaces collapsed."""
    total = theory.model_state_total(psi, n, stage, optimizer_bytes=k)
    table = theory.format_memory_table(psi, n, optimizer_bytes=k).splitlines()
    return ([" ".join(line.split()) for line in table]
            + [f"K = {k:g}; chosen: {theory.STAGE_NAMES[stage]} -> {total / 1e9:.4g} GB per rank"])


BUDGET = float(os.environ.get("ZEROLAB_BROWSER_BUDGET", "150"))    # seconds, all waits together
INTERACT = "//div[contains(@class,'widget-interact')]"


class _Waiter:
    """Explicit waits on named conditions, sharing one deadline; a timeout fails the test with
    what was awaited, the seconds waited, and the tail of JupyterLab's log."""

    def __init__(self, driver, log: Path, budget: float):
        self.driver, self.log, self.deadline = driver, log, time.monotonic() + budget

    def __call__(self, what: str, condition, seconds: float | None = None, fail: bool = True):
        from selenium.common.exceptions import (
            StaleElementReferenceException,
            TimeoutException,
        )
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
    png = base64.b64decode(data_url.split(",", 1)[1])
    rgb = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    ink = (rgb < 0.9).any(axis=-1)
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25
    return float(ink.mean()), int(coloured.sum())


def _figures(nb_path: Path) -> list[str]:
    """The `../images/NAME.png` figures of a notebook's markdown, as NAME.png."""
    nb = json.loads(nb_path.read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return re.findall(r"\]\(\.\./images/([^)\s]+)\)", text)


def _listing(base: str, token: str, path: str = "") -> set[str]:
    with urllib.request.urlopen(f"{base}/api/contents/{path}?token={token}", timeout=10) as resp:
        return {item["name"] for item in json.load(resp)["content"]}


@pytest.mark.timeout(300)
def test_readme_command_opens_the_course_and_the_calculator_is_exact(jupyterlab, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC

    base, token, log, runtime = jupyterlab
    served = _listing(base, token)
    assert COURSE_ROOT <= served, (f"README's command `{shlex.join(readme_command())}` serves "
                                   f"{sorted(served)}, not the repository's root")
    figures = _figures(NOTEBOOK)
    assert figures, "notebook 02 shows no figure from images/"

    # the URL the command opens in the learner's browser (it wrote it although --no-browser)
    opened = list(runtime.glob("jpserver-file-to-run-*-open.html"))
    assert len(opened) == 1, f"no file-to-run page in {sorted(p.name for p in runtime.iterdir())}"
    url = re.search(r'href="([^"]+)"', opened[0].read_text()).group(1)
    assert url.split("?")[0].endswith("/lab/tree/notebooks/01_welcome.ipynb"), url

    driver = _driver(tmp_path)
    shot = tmp_path / "calculator.png"
    wait = _Waiter(driver, log, BUDGET)
    k_xpath = "//div[contains(@class,'widget-hslider')][.//label[normalize-space()='K']]"
    psi_xpath = "//div[contains(@class,'widget-text')][.//label[normalize-space()='Ψ']]//input"
    output = INTERACT + "//div[contains(@class,'widget-output') or contains(@class,'jupyter-widget-output')]"

    def panel(drv, name):
        """The notebook panel of the current tab, if that tab is `name`."""
        for tab in drv.find_elements(By.CSS_SELECTOR, ".lm-DockPanel-tabBar .lm-mod-current"):
            if tab.text.strip() == name and tab.get_attribute("data-id"):
                found = drv.find_elements(By.ID, tab.get_attribute("data-id"))
                if found and found[0].find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"):
                    return found[0]
        return None

    def shows(lines):
        def check(drv):
            _accept_kernel_dialog(drv)
            if _errors(drv):        # fail at once, with the error, instead of timing out
                raise AssertionError("the calculator shows an error:\n" + _errors(drv)[0][-1500:])
            texts = [" ".join(e.text.split()) for e in drv.find_elements(By.XPATH, output)]
            return next((t for t in texts if all(line in t for line in lines)), None)
        return check

    def type_psi(text):
        box = driver.find_element(By.XPATH, psi_xpath)
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(text, Keys.ENTER)

    try:
        started = time.monotonic()
        driver.get(url)
        wait("notebook 01 to open (the command's file)", lambda drv: panel(drv, "01_welcome.ipynb"))

        def file_item(drv, name):
            items = drv.find_elements(By.CSS_SELECTOR, ".jp-DirListing-content .jp-DirListing-item")
            return next((i for i in items if i.text.split("\n")[0].strip() == name), None)

        clicked = {}

        def open_from_file_browser(drv):    # double-click notebooks/, then 02_memory.ipynb
            for name in (NOTEBOOK.name, "notebooks"):
                item = file_item(drv, name)
                if item is not None and item.is_displayed():
                    if time.monotonic() - clicked.get(name, -10) > 5:   # once, or again after 5 s
                        clicked[name] = time.monotonic()
                        ActionChains(drv).double_click(item).perform()
                    break
            return panel(drv, NOTEBOOK.name)
        nb02 = wait("notebook 02 to open from the file browser", open_from_file_browser)
        idle = ".jp-Notebook-ExecutionIndicator[data-status='idle']"

        def kernel_idle(drv):               # 02's kernel started (no dialog left open) and idle
            _accept_kernel_dialog(drv)
            names = [e.text for e in nb02.find_elements(By.CSS_SELECTOR, ".jp-Toolbar-kernelName")]
            return (not drv.find_elements(By.CSS_SELECTOR, ".jp-Dialog")
                    and nb02.find_elements(By.CSS_SELECTOR, idle)
                    and any("Python" in name for name in names))
        wait("notebook 02's kernel to start (toolbar: a Python kernel, no dialog, status idle)",
             kernel_idle)

        # (a) the figures from images/ are loaded and decoded in 02's rendered markdown
        def figures_loaded(drv):
            imgs = [i for i in nb02.find_elements(By.CSS_SELECTOR, ".jp-RenderedMarkdown img")
                    if any(name in (i.get_attribute("src") or "") for name in figures)]
            for img in imgs:
                drv.execute_script("arguments[0].scrollIntoView({block: 'center'});", img)
            loaded = [i.get_attribute("src") for i in imgs if drv.execute_script(
                "return arguments[0].complete && arguments[0].naturalWidth > 0;", i)]
            return loaded if len(loaded) == len(figures) else None
        loaded = wait(f"02's figures {figures} to load (naturalWidth > 0)", figures_loaded)
        print("figures:", *loaded, sep="\n  ")

        wait("the Run menu", EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']"))).click()
        wait("Run > Run All Cells", EC.element_to_be_clickable(
            (By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Run All Cells']"))
        ).click()
        # (b) the calculator opens at exactly Ψ = 7.5e9, N = 64, ZeRO-3, K = 12
        wait("the calculator's Ψ box (the last cell ran)",
             EC.presence_of_element_located((By.XPATH, psi_xpath)))
        assert driver.find_element(By.XPATH, psi_xpath).get_attribute("value") == "7.5e9"
        wait("the calculator's table for Ψ = 7.5e9, K = 12", shows(_table_lines(7.5e9, 64, 3, 12)))
        wait("every cell to finish (no [*] prompt) and the kernel to be idle", lambda drv: not any(
            "[*]" in e.text for e in nb02.find_elements(By.CSS_SELECTOR, ".jp-InputPrompt"))
            and nb02.find_elements(By.CSS_SELECTOR, idle))

        # Ψ typed: another value, then the paper's exactly
        type_psi("70B")
        wait("the table for Ψ typed as 70B (7e10)", shows(_table_lines(7e10, 64, 3, 12)))
        type_psi("7.5e9")
        paper = wait("the table for Ψ typed as 7.5e9", shows(_table_lines(7.5e9, 64, 3, 12)))
        totals = {name: float(m.group(1)) for name in theory.STAGE_NAMES.values()
                  if (m := re.search(rf"{name} (?:\S+ ){{5}}(\S+) \S+Ψ", paper))}
        expected = {theory.STAGE_NAMES[s]: round(theory.model_state_total(7.5e9, 64, s) / 1e9, 1)
                    for s in theory.STAGES}
        assert {name: round(gb, 1) for name, gb in totals.items()} == expected, (totals, expected)
        print("Ψ = 7.5e9, N = 64, GB per rank:", " / ".join(f"{gb:g}" for gb in expected.values()))

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
        wait("the calculator's table for K = 13", shows(_table_lines(7.5e9, 64, 3, 13)))
        plot = wait("a new plot image after the slider move (K = 13)", new_plot(exclude=old_plot))
        assert not _errors(driver), _errors(driver)[0][-1500:]
        ink, coloured = _ink(plot)
        print(f"calculator plot after the move: {len(plot) * 3 // 4:,}-byte PNG, "
              f"{ink:.1%} of pixels inked, {coloured:,} coloured")
        assert ink > 0.02 and coloured > 500, \
            f"the plot after the move is blank: {ink:.2%} of pixels inked, {coloured} coloured"
        box = driver.find_element(By.XPATH, INTERACT)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", box)
        print(f"in the browser: {time.monotonic() - started:.0f} s")
    finally:
        driver.save_screenshot(str(shot))
        (tmp_path / "page.html").write_text(driver.page_source)      # for a failed run
        driver.quit()
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
