"""The learner's path: JupyterLab in a real (headless) browser, run-all, and what the learner sees.

Run with ``make test-browser`` (installs Playwright for Python and, as root, Debian's chromium). Starts
JupyterLab exactly as ``make lab`` does (``mgpu_helpers.tools.lab.start``) on a free loopback port over a
scratch copy of ``solutions/`` (the run saves the notebooks; the repository is never written), opens
each notebook in Chromium, runs all cells from the Run menu, saves, and asserts: no error outputs, the
check cells' "✓" lines on screen, plots rendered as images, progress bars drawn as widgets, never as text, and (in the
capstone) the ipywidgets calculator rendered and redrawing its plot when a slider moves.
Screenshots go to ``test-output/browser/``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools import lab

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-output" / "browser"
CHROMIUM = os.environ.get("MGPU_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a closed network and root: no sandbox as root, no background
# connections that a machine without internet refuses by the dozen.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
CAPSTONE = sorted((ROOT / "solutions").glob("11_*.ipynb"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "solutions", work / "solutions")
    shutil.copytree(ROOT / "notebooks", work / "notebooks")  # what `make lab` serves to learners
    for f in (work / "solutions").glob("*.ipynb"):  # as a learner opens them: nothing run yet
        nb = nbformat.read(str(f), as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                c.outputs, c.execution_count = [], None
        nbformat.write(nb, str(f))
    settings = work / ".settings"
    # Render every cell (JupyterLab's windowed notebook draws only cells near the viewport).
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(work / ".workspaces"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    proc, token, info = lab.start(work, port=_free_port(), env=env, log=SHOTS / "jupyterlab.log")
    try:
        yield {"base": f"http://localhost:{info['port']}/", "token": token, "work": work}
    finally:
        lab.stop(proc)
        shutil.rmtree(info["runtime_dir"], ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test-browser` installs Debian's chromium (as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def _run_all(page, server, rel: str, timeout_s: float = 300) -> None:
    # JupyterLab's launcher first (its kernel cards mean the kernel specs are loaded; a notebook opened
    # before that, on a slow machine, asks "Select Kernel"), then the notebook by the URL `make lab` prints.
    # Each notebook in its own fresh workspace (`?reset`): the default one would reopen the previous
    # test's notebook instead of the launcher.
    ws = f"{server['base']}lab/workspaces/{Path(rel).stem.replace('_', '-')}"
    page.goto(f"{ws}?reset&token={server['token']}")
    page.wait_for_selector(".jp-LauncherCard", timeout=120_000)
    page.goto(f"{ws}/tree/{rel}?token={server['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    # Kernel ready: the toolbar's kernel status reads Idle.
    page.wait_for_function("() => [...document.querySelectorAll('.jp-Notebook-ExecutionIndicator')]"
                           ".some(e => e.getAttribute('data-status') === 'idle')", timeout=120_000)
    _one_settled_kernel(server, rel)
    # Run > Run All Cells, as a learner would; done when no prompt shows [*] and every code cell has a number.
    deadline, started = time.monotonic() + timeout_s, time.monotonic()
    clicks, last, last_change = 0, None, time.monotonic()
    while True:
        state = page.evaluate("""() => {
            const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent);
            return {busy: p.filter(t => t.includes('*')).length, unrun: p.filter(t => !/\\d/.test(t)).length,
                    n: p.length, dialog: [...document.querySelectorAll('.jp-Dialog')].map(e => e.innerText).join(' | ')};
        }""")
        if state["dialog"]:
            page.screenshot(path=str(SHOTS / (Path(rel).stem + "_dialog.png")))
            pytest.fail(f"{rel}: a dialog stands in the learner's way: {state['dialog']!r}")
        if state["n"] and not state["busy"] and not state["unrun"]:
            break
        if state != last:
            last, last_change = state, time.monotonic()
        # Nothing running and cells left: click Run All (again, at most twice more: requests sent while
        # JupyterLab swaps a kernel it started twice for one notebook are lost -- its race, not the course's).
        stalled = not state["busy"] and (clicks == 0 or time.monotonic() - last_change > 20)
        if stalled and clicks < 3:
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            clicks, last_change = clicks + 1, time.monotonic()
        elif stalled or time.monotonic() > deadline:
            page.screenshot(path=str(SHOTS / (Path(rel).stem + "_stuck.png")))
            pytest.fail(f"{rel}: run-all did not finish after {clicks} clicks ({state}, "
                        f"{time.monotonic() - started:.0f} s)")
        time.sleep(1)
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)


def _one_settled_kernel(server, rel: str, timeout: float = 60) -> None:
    """Wait until the notebook has one session whose kernel has stayed the same, and idle, for 2 s: on a
    fresh server JupyterLab may start two kernels for one notebook and shut one down."""
    req = urllib.request.Request(server["base"] + "api/sessions", headers={"Authorization": f"token {server['token']}"})
    deadline, seen, since, sessions = time.monotonic() + timeout, None, time.monotonic(), None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                sessions = json.loads(r.read())
        except OSError:  # the server answers 500 while a kernel it is starting is half made: ask again
            sessions = None
        kernels = [s["kernel"] for s in sessions or [] if s.get("path") == rel]
        now = kernels[0]["id"] if len(kernels) == 1 and kernels[0].get("execution_state") == "idle" else None
        if now != seen:
            seen, since = now, time.monotonic()
        elif now and time.monotonic() - since >= 2:
            return
        time.sleep(0.5)
    pytest.fail(f"{rel}: no settled kernel after {timeout:.0f} s (sessions: {sessions})")


def _saved(server, rel: str):
    return nbformat.read(str(server["work"] / rel), as_version=4)


def _assert_learner_sees(page, server, rel: str) -> None:
    nb = _saved(server, rel)
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{rel}: error outputs in cells {errors}"
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.get("output_type") == "stream"]
    # A progress bar that fell back to text prints a wall of '\r…%|███' lines.
    assert not any("%|" in t for t in texts), f"{rel}: a progress bar printed as text"
    checks = [c for c in nb.cells if "check" in c.get("metadata", {}).get("tags", [])]
    shown = page.locator(".jp-OutputArea-output").all_inner_texts()
    for c in checks:
        ex = c.metadata["mgpu"]["check"]
        assert any(f"Exercise {ex} ✓" in t for t in shown), f"{rel}: no 'Exercise {ex} ✓' on screen"
    n_images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if "image/png" in o.get("data", {}))
    assert n_images > 0 or not _has_plots(rel), f"{rel}: no plot was produced"
    rendered = page.locator(".jp-RenderedImage img").count()
    assert rendered >= n_images, f"{rel}: {n_images} plots in the notebook, {rendered} rendered as images"
    if _has_bars(rel):  # a bar, drawn as a widget
        bars = page.locator(".widget-progress, .widget-hprogress, .jp-OutputArea-output progress").count()
        assert bars > 0, f"{rel}: the progress bar did not render as a widget"


def _has_bars(rel: str) -> bool:
    """Whether CI's reference run drew a progress bar (tqdm.auto's widget) in this notebook."""
    stored = nbformat.read(str(ROOT / "solutions" / Path(rel).name), as_version=4)
    return any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) and "%|" in o["data"].get("text/plain", "")
               for c in stored.cells if c.cell_type == "code" for o in c.outputs)


def _has_plots(rel: str) -> bool:
    stored = nbformat.read(str(ROOT / "solutions" / Path(rel).name), as_version=4)  # CI's reference run
    return any("image/png" in o.get("data", {}) for c in stored.cells if c.cell_type == "code" for o in c.outputs)


def test_first_notebook_as_make_lab_opens_it(server, browser):
    """The learner's first step: notebooks/00_setup.ipynb (the released copy), opened and run."""
    rel = "notebooks/00_setup.ipynb"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _run_all(page, server, rel)
        page.screenshot(path=str(SHOTS / "00_setup.png"))
        _assert_learner_sees(page, server, rel)
        shown = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "rank 1 of 2: sum = 3" in shown, "the ranks launched from the browser's kernel said nothing"
    finally:
        page.close()


def _shoot_first_plot(page, rel: str) -> None:
    # JupyterLab scrolls inside its own panel, so a full-page screenshot shows only the viewport: bring
    # the first plot into view for the record.
    img = page.locator(".jp-RenderedImage img").first
    img.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / (Path(rel).stem + "_plot.png")))


@pytest.mark.parametrize("rel", ["solutions/01_where_memory_goes.ipynb", "solutions/04_ddp.ipynb",
                                 "solutions/07_activation_checkpointing.ipynb"])
def test_run_all_in_jupyterlab(server, browser, rel):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _run_all(page, server, rel)
        page.screenshot(path=str(SHOTS / (Path(rel).stem + ".png")), full_page=True)
        _assert_learner_sees(page, server, rel)
        _shoot_first_plot(page, rel)
        # The JupyterLab news pop-up must not sit over the notebook.
        assert page.locator(".jp-toast-message", has_text="news").count() == 0, "news pop-up shown"
    finally:
        page.close()


@pytest.mark.skipif(not CAPSTONE, reason="the capstone notebook does not exist yet")
def test_capstone_widget_responds(server, browser):
    rel = f"solutions/{CAPSTONE[0].name}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _run_all(page, server, rel)
        _assert_learner_sees(page, server, rel)
        slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text="world size")).first
        assert slider.count() == 1, "the calculator's 'world size' slider is not rendered"
        slider.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "11_widget_before.png"), full_page=True)
        box = slider.locator(".widget-readout")
        before_value = box.inner_text()
        def img():  # the calculator's plot, as the browser holds it
            return page.locator(".widget-output .jp-RenderedImage img, .widget-output img").evaluate_all(
                "els => els.map(e => e.src).join('|')")

        before_img = img()
        assert before_img, "the calculator shows no plot"
        slider.locator(".noUi-handle, .slider-handle, .ui-slider-handle").first.click()
        page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and img() == before_img:
            time.sleep(0.5)
        page.screenshot(path=str(SHOTS / "11_widget_after.png"), full_page=True)
        assert box.inner_text() != before_value, f"the slider did not move (still {before_value})"
        assert img() != before_img, "moving the slider did not redraw the plot"
    finally:
        page.close()
