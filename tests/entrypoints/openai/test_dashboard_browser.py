"""The dashboard in a real browser: Debian's chromium, driven by Playwright, opens /dashboard on the real
server while requests with a common prefix run, and reads the grid as the page draws it.

Skipped, with the reason printed, where chromium or Playwright is missing (`make install-browser`
installs both). With ``PAGELLM_DASHBOARD_SCREENSHOT=docs/dashboard.png`` the screenshot taken during
the workload is also written there: that is docs/dashboard.md's (`make dashboard-screenshot`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

pytestmark = pytest.mark.browser

# Chromium's flags for a closed network: no background connections, no component updates.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
API_KEY = "dashboard-key"
NUM_BLOCKS = 128
BLOCK_SIZE = 16
PREFIX = [(7 * i) % 400 + 20 for i in range(4 * BLOCK_SIZE)]  # four full blocks every request starts with
NUM_REQUESTS = 6
MAX_TOKENS = 360
SHARED = '#kv-grid [data-state="shared"]'
PRELOADED = ("Paged attention stores the cache in fixed size blocks, like pages of virtual memory in an operating "
             "system, and each sequence keeps a block table that maps its logical blocks to physical ones.")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_browser() -> str | None:
    """Why the browser test cannot run here, or None."""
    if chromium_path() is None:
        return "Debian's chromium is not installed (apt-get install -y chromium, or make install-browser)"
    if importlib.util.find_spec("playwright") is None:
        return ("the playwright package is not installed (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 pip install -c "
                "constraints.txt playwright, or make install-browser)")
    return None


@pytest.fixture(scope="module")
def browser():
    reason = missing_browser()
    if reason is not None:
        print(f"\nthe dashboard's browser test is skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    # A prompt preloaded at start-up: its full blocks are pinned (never evicted).
    preload = tmp_path_factory.mktemp("preload") / "prompts.json"
    preload.write_text(json.dumps([PRELOADED]))
    srv = RemoteServer(llama_path, [
        "--served-model-name", "tiny", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "512", "--max-num-seqs", "4", "--preload-prompts", str(preload),
    ], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


class SharedPrefixWorkload:
    """Requests that start with the same prefix: the first alone until its prompt is done (its full
    blocks are then cached), the others after it, adopting those blocks."""

    def __init__(self, server: RemoteServer, num_requests: int = NUM_REQUESTS, max_tokens: int = MAX_TOKENS) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.first_token = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_requests)]

    def start(self) -> SharedPrefixWorkload:
        self.threads[0].start()
        if not self.first_token.wait(60):
            raise AssertionError("the first request produced no token")
        for t in self.threads[1:]:
            t.start()
        return self

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not self.errors, self.errors

    def _run(self, i: int) -> None:
        body = {"model": "tiny", "prompt": PREFIX + [500 + i, 501 + i], "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body, headers=self.server.headers,
                              timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        json.loads(line[6:])
                        self.first_token.set()
        except BaseException as e:  # reported by join()
            self.errors.append(e)
            self.first_token.set()


def test_dashboard_draws_the_pool_and_shared_prefix_blocks_live(browser, server, tmp_path):
    # As an operator would: the browser asks for the key (HTTP Basic, the key as the password).
    context = browser.new_context(http_credentials={"username": "operator", "password": API_KEY},
                                  viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(f"{m.text} ({m.location})") if m.type == "error" else None)
    page.goto(server.url + "/dashboard?interval=250")
    page.wait_for_selector("body[data-renders]")

    # One cell per block of the pool; before any request, every one free but the preloaded prompt's.
    state = httpx.get(server.url + "/v1/kv_cache/state", headers=server.headers).json()
    assert page.locator("#kv-grid [data-block-id]").count() == state["pool"]["num_blocks"] == NUM_BLOCKS
    pinned = state["pool"]["counts"]["pinned"]
    assert pinned >= 1 and page.locator('#kv-grid [data-state="pinned"]').count() == pinned
    assert page.locator('#kv-grid [data-state="free"]').count() == NUM_BLOCKS - pinned
    assert page.locator("#requests tbody tr").count() == 0
    assert "tiny" in page.locator("#model").inner_text()
    assert page.locator("#settings").inner_text().count("num_kv_blocks") == 1

    # A request that ends leaves its full blocks cached (evictable), with their hash.
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    page.wait_for_selector('#kv-grid [data-state="cached"]', timeout=30_000)
    assert "hash" in page.locator('#kv-grid [data-state="cached"]').first.get_attribute("title")

    workload = SharedPrefixWorkload(server).start()
    try:
        # The prefix blocks appear shared while the requests run: ref count and holders on the cell.
        page.wait_for_selector(SHARED, timeout=60_000)
        cell = page.locator(SHARED).first
        assert int(cell.get_attribute("data-ref-count")) >= 2
        title = cell.get_attribute("title")
        assert "shared by" in title and "hash" in title and len(cell.get_attribute("data-requests").split()) >= 2
        assert page.locator(SHARED).count() >= len(PREFIX) // BLOCK_SIZE
        cell.hover()  # the detail line follows the hovered cell (whose holders may grow meanwhile)
        page.wait_for_function("""() => {
            const cell = document.querySelector('#kv-grid .selected');
            return cell !== null && document.querySelector('#block-detail').textContent === cell.title;
        }""", timeout=10_000)
        assert page.locator("#requests tbody tr").count() >= 2
        assert page.locator('#requests tbody tr[data-queue="running"]').count() >= 2
        _wait_for_chart_points(page)
        shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert shot[:4] == b"\x89PNG"
        target = os.environ.get("PAGELLM_DASHBOARD_SCREENSHOT")
        if target:
            Path(target).write_bytes(shot)
    finally:
        workload.join()

    # Once the workload is over: no request listed, no block in use; the prefix stays cached.
    page.wait_for_function(
        """() => document.querySelectorAll('#requests tbody tr').length === 0
                 && !document.querySelector('#kv-grid [data-state="shared"], #kv-grid [data-state="used"]')""",
        timeout=30_000)
    assert page.locator('#kv-grid [data-state="cached"]').count() >= len(PREFIX) // BLOCK_SIZE
    assert page.locator("#kv-grid [data-block-id]").count() == NUM_BLOCKS
    assert page.locator("#requests-empty").is_visible()
    assert page.locator("#status").get_attribute("data-status") == "live"
    assert not errors, errors
    context.close()


def _wait_for_chart_points(page, points: int = 3) -> None:
    """A few seconds of throughput on the charts for the screenshot, while the prefix is still shared
    (not asserted: a slow machine may end the workload first)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(
            f"""() => Number(document.querySelector('#chart-tput').dataset.nonzero || 0) >= {points}
                     && document.querySelector('{SHARED}') !== null""", timeout=10_000)
