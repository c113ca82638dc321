"""The web page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``make test`` where it can) driven by Selenium.

It loads the page with the token in the URL fragment, paints a mask on the canvas, sees the
live mask ratio, submits the edit as a job, watches the progress bar reach the last step,
finds the result image, then checks the dashboard. A screenshot of the finished page is
written to ``$RETOUCH_SCREENSHOT`` when set (``docs/playground.png`` was made so).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retouch.platform.client import Client, read_spec_file
from retouch.platform.server import ServerProcess
from tests.support import wait_for

from .conftest import ADMIN, INVOKE, TOKENS

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (a dev dependency)")

FUNCTION, STEPS = "web-sd", 8
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(data_dir: Path, examples: Path) -> Iterator[ServerProcess]:
    args = ["--progress-interval", "0"]
    with ServerProcess(data_dir, env=TOKENS, extra_args=args) as proc:
        spec, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(spec, name=FUNCTION, steps=STEPS)
        with Client(proc.url, ADMIN) as admin:
            assert admin.deploy(spec, images)["status"] == "ready"
        yield proc


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "no Chromium here: install Debian's chromium and chromium-driver "
            "(make test does, as root with apt)"
        )
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, predicate, timeout: float, what: str):
    """``wait_for`` on the page; a timeout shows the browser's log."""

    def browser_log() -> object:
        return driver.get_log("browser") if hasattr(driver, "get_log") else []

    return wait_for(what, lambda: predicate(driver), timeout, 0.05, detail=browser_log)


def test_page_and_static_files_are_served(server: ServerProcess) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (
        ("app.js", "javascript"),
        ("msgpack.js", "javascript"),
        ("style.css", "css"),
    ):
        resp = httpx.get(f"{server.url}/ui/{name}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"]
    for bad in ("../gateway.py", "nope.js", "__init__.py"):
        resp = httpx.get(f"{server.url}/ui/{bad}")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "route_not_found"
    # the data behind the page needs the token
    assert httpx.get(f"{server.url}/v1/functions").status_code == 401
    tpl = httpx.get(
        f"{server.url}/v1/functions/{FUNCTION}/templates/street",
        headers={"authorization": f"Bearer {INVOKE}"},
    )
    assert tpl.status_code == 200 and tpl.content.startswith(b"\x89PNG")
    for path, code, field in (
        (f"/v1/functions/{FUNCTION}/templates/nope", "template_not_found", "template"),
        ("/v1/functions/nope/templates/street", "function_not_found", "name"),
    ):
        resp = httpx.get(server.url + path, headers={"authorization": f"Bearer {INVOKE}"})
        error = resp.json()["error"]
        assert (resp.status_code, error["code"], error["field"]) == (404, code, field)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_playground_paints_submits_and_shows_the_result(server: ServerProcess, browser) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    driver.get(f"{server.url}/#token={INVOKE}")
    find = driver.find_element
    wait(
        driver,
        lambda d: (
            FUNCTION in [o.get_attribute("value") for o in Select(find(By.ID, "function")).options]
        ),
        60,
        "the function list",
    )
    assert "token" not in driver.current_url  # moved to localStorage, out of the address bar
    assert driver.execute_script("return localStorage.getItem('retouch.token')") == INVOKE
    Select(find(By.ID, "function")).select_by_value(FUNCTION)
    Select(find(By.ID, "template")).select_by_value("street")
    wait(
        driver,
        lambda d: (find(By.ID, "original").get_attribute("src") or "").startswith("blob:"),
        30,
        "the template image",
    )

    canvas = find(By.ID, "mask-canvas")
    assert find(By.ID, "mask-ratio").text == "0.0 %"
    size = canvas.size
    actions = ActionChains(driver)
    actions.move_to_element_with_offset(canvas, -size["width"] // 5, -size["height"] // 6)
    actions.click_and_hold()
    for step in range(12):
        actions.move_by_offset(size["width"] // 30, (-1) ** step * 6)
    actions.release().perform()
    ratio = wait(
        driver,
        lambda d: float(find(By.ID, "mask-ratio").get_attribute("data-ratio") or 0),
        10,
        "a live mask ratio",
    )
    assert 0.01 < ratio < 0.6
    assert (
        find(By.ID, "mask-ratio").text.endswith("%") and find(By.ID, "mask-ratio").text != "0.0 %"
    )
    # invert: the ratio follows live; undo restores the stroke
    find(By.ID, "invert").click()
    inverted = float(find(By.ID, "mask-ratio").get_attribute("data-ratio"))
    assert abs(inverted - (1 - ratio)) < 0.01
    find(By.ID, "undo").click()
    assert abs(float(find(By.ID, "mask-ratio").get_attribute("data-ratio")) - ratio) < 1e-9

    prompt = find(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("a red door")
    seed = find(By.ID, "seed")
    seed.clear()
    seed.send_keys("3")
    find(By.ID, "submit").click()

    # the progress bar fills step by step to the end, then the result appears
    seen = set()

    def progressed(d):
        bar = find(By.ID, "progress")
        seen.add(int(float(bar.get_attribute("value"))))
        return int(float(bar.get_attribute("max"))) == STEPS and STEPS in seen

    wait(driver, progressed, 180, "the progress bar to reach the last step")
    assert len(seen - {0}) >= 2, seen  # it moved in steps, not in one jump
    src = wait(
        driver, lambda d: find(By.ID, "result").get_attribute("src") or "", 60, "the result image"
    )
    assert src.startswith("blob:")
    assert find(By.ID, "job-state").text.startswith("succeeded")
    assert driver.execute_script("return document.getElementById('result').naturalWidth") == 128
    assert not find(By.ID, "download").get_attribute("hidden")
    assert "path" in find(By.ID, "result-info").text

    # copy as curl: the exact job request, which the API accepts again
    find(By.ID, "copy-curl").click()
    curl = wait(
        driver, lambda d: find(By.ID, "curl-text").get_attribute("value"), 10, "the curl command"
    )
    encoded = curl.split("echo '")[1].split("'")[0]
    resp = httpx.post(
        f"{server.url}/v1/functions/{FUNCTION}/jobs",
        content=base64.b64decode(encoded),
        headers={"authorization": f"Bearer {INVOKE}", "content-type": "application/msgpack"},
    )
    assert resp.status_code == 202

    shot = os.environ.get("RETOUCH_SCREENSHOT")
    if shot:
        driver.save_screenshot(shot)

    # the dashboard refreshes itself with the executor, its model and the template residency
    find(By.ID, "tab-dashboard").click()
    wait(driver, lambda d: "exec-0" in find(By.ID, "executors").text, 30, "the executors table")
    table = find(By.ID, "executors").text
    assert "ready" in table and "retouch:tiny-sd" in table and f"{FUNCTION}/street" in table
    before = find(By.ID, "d-updated").text
    wait(driver, lambda d: find(By.ID, "d-updated").text != before, 10, "a dashboard refresh")
    assert int(find(By.ID, "d-invocations").text) >= 1
    assert find(By.ID, "d-latency").text != "–"
