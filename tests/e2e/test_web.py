"""The web page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``make test`` where it can) driven by Selenium.

It loads the page with the token in the URL fragment, paints a mask on the canvas, sees the
live mask ratio, picks one of the function's example prompts, sets steps, guidance and a
negative prompt, submits the edit as a job, watches the progress bar reach the last step,
finds the result image and checks the job ran with those settings, then checks the
dashboard. A screenshot of the finished page is
written to ``$RETOUCH_SCREENSHOT`` when set (``docs/playground.png`` was made so).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import InvokeRequest
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from tests.support import EXAMPLES, wait_for

from .conftest import ADMIN, INVOKE, TOKENS

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (a dev dependency)")

FUNCTION, STEPS = "web-sd", 8
EDIT_STEPS, EDIT_GUIDANCE, NEGATIVE = 3, 4.5, "blurry, dark"  # what the test sets on the page
SPEC = read_spec_file(EXAMPLES / "tiny-sd.toml")[0]  # the function's, but for its steps
PROMPTS = SPEC.examples
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(data_dir: Path, examples: Path) -> Iterator[ServerProcess]:
    args = ["--progress-interval", "0"]
    with ServerProcess(data_dir, env=TOKENS, extra_args=args) as proc:
        _, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(SPEC, name=FUNCTION, steps=STEPS)
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


AUTH = {"authorization": f"Bearer {INVOKE}"}
# The result image's pixels as the page shows them (RGBA rows, base64): drawn on a canvas,
# since the page's CSP keeps fetch() off its blob URLs.
READ_RESULT = """
const img = document.getElementById("result");
const c = document.createElement("canvas");
c.width = img.naturalWidth;
c.height = img.naturalHeight;
const ctx = c.getContext("2d");
ctx.drawImage(img, 0, 0);
const data = ctx.getImageData(0, 0, c.width, c.height).data;
let s = "";
for (let i = 0; i < data.length; i += 0x8000) s += String.fromCharCode(...data.subarray(i, i + 0x8000));
return btoa(s);
"""


def post(
    server: ServerProcess, route: str, content: bytes, ctype: str = "application/msgpack"
) -> httpx.Response:
    """A request to the function's ``invoke`` or ``jobs`` route."""
    headers = {**AUTH, "content-type": ctype}
    url = f"{server.url}/v1/functions/{FUNCTION}/{route}"
    return httpx.post(url, content=content, headers=headers, timeout=60)


def invoke(server: ServerProcess, body: dict) -> bytes:
    """The pixels (RGBA rows) of the image a synchronous invoke of ``body`` answers."""
    resp = post(server, "invoke", pack(body))
    assert resp.status_code == 200, resp.text
    return Image.open(io.BytesIO(unpack(resp.content)["image"])).convert("RGBA").tobytes()


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
    # the function's example prompts, which the page offers
    doc = httpx.get(f"{server.url}/v1/functions/{FUNCTION}", headers=AUTH).json()
    assert doc["examples"] == list(PROMPTS)
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

    # the prompt starts at the function's first example, the settings at its own
    def value(element_id: str) -> str:
        return find(By.ID, element_id).get_attribute("value")

    examples = Select(find(By.ID, "examples"))
    assert [o.text for o in examples.options] == list(PROMPTS) and len(PROMPTS) >= 2
    assert value("prompt") == PROMPTS[0]
    assert (value("steps"), float(value("guidance")), value("strength")) == (
        str(STEPS),
        SPEC.guidance,
        "1",
    )
    examples.select_by_index(1)
    assert value("prompt") == PROMPTS[1]
    for element_id, text in (
        ("steps", str(EDIT_STEPS)),
        ("guidance", str(EDIT_GUIDANCE)),
        ("negative-prompt", NEGATIVE),
        ("seed", "3"),
        ("strength", "0"),  # out of (0, 1]: refused on the page, naming the field
    ):
        find(By.ID, element_id).clear()
        find(By.ID, element_id).send_keys(text)
    find(By.ID, "submit").click()
    toast = wait(driver, lambda d: find(By.ID, "toast").text, 10, "the strength error")
    assert "strength" in toast and find(By.ID, "job-state").text == "no job yet"
    find(By.ID, "strength").clear()
    find(By.ID, "strength").send_keys("1")
    find(By.ID, "submit").click()

    # the progress bar fills step by step to the end, then the result appears
    seen = set()

    def progressed(d):
        bar = find(By.ID, "progress")
        seen.add(int(float(bar.get_attribute("value"))))
        return int(float(bar.get_attribute("max"))) == EDIT_STEPS and EDIT_STEPS in seen

    wait(driver, progressed, 180, "the progress bar to reach the last step")
    assert len(seen - {0}) >= 2, seen  # it moved in steps, not in one jump
    src = wait(
        driver, lambda d: find(By.ID, "result").get_attribute("src") or "", 60, "the result image"
    )
    assert src.startswith("blob:")
    assert find(By.ID, "job-state").text.startswith("succeeded")
    assert driver.execute_script("return document.getElementById('result').naturalWidth") == 128
    assert not find(By.ID, "download").get_attribute("hidden")
    assert f"path stock · {EDIT_STEPS} steps" in find(By.ID, "result-info").text
    job_id = find(By.ID, "result").get_attribute("data-job")
    job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=AUTH).json()
    assert job["result"]["engine"]["steps"] == EDIT_STEPS  # the executor ran the page's steps

    # copy as curl: the job request as JSON, which the API accepts again
    find(By.ID, "copy-curl").click()
    curl = wait(
        driver, lambda d: find(By.ID, "curl-text").get_attribute("value"), 10, "the curl command"
    )
    sent = curl.split("<<'JSON'\n")[1].rsplit("\nJSON", 1)[0]
    body = json.loads(sent)
    assert {"num_inference_steps", "guidance_scale", "negative_prompt", "strength"} <= set(body)
    request = InvokeRequest.from_wire(body)  # as the gateway reads it
    assert (request.prompt, request.negative_prompt, request.seed) == (PROMPTS[1], NEGATIVE, 3)
    assert (request.steps, request.guidance, request.strength) == (EDIT_STEPS, EDIT_GUIDANCE, 1.0)
    # the guidance reached the model: the same request invoked again gives the page's
    # image (edits are deterministic), and at the function's own guidance another one
    shown = base64.b64decode(driver.execute_script(READ_RESULT))
    assert invoke(server, body) == shown
    assert invoke(server, {**body, "guidance_scale": SPEC.guidance}) != shown
    assert post(server, "jobs", sent.encode(), "application/json").status_code == 202

    shot = os.environ.get("RETOUCH_SCREENSHOT")
    if shot:  # the whole playground, its settings included
        driver.set_window_size(1280, 1200)
        driver.execute_script("window.scrollTo(0, 0)")
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
