"""The browser demo (top-level web/, installed as `streamworld.web`) in a real headless Chromium,
against a real `streamworld serve`.

Needs Playwright for Python and a Chromium binary (Debian: `apt-get install -y chromium`;
Playwright's own browser download is not used). Without them these tests are skipped with
the reason shown, unless STREAMWORLD_REQUIRE_BROWSER=1 (CI sets it), which makes a missing
browser a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = os.environ.get("STREAMWORLD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
REQUIRED = os.environ.get("STREAMWORLD_REQUIRE_BROWSER") == "1"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

_missing = (
    "Playwright for Python is not installed (pip install playwright)"
    if sync_playwright is None
    else None
    if os.path.exists(CHROMIUM)
    else f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
)
if _missing and REQUIRED:
    raise RuntimeError(f"browser tests required but {_missing}")
# Skipped only where the browser is missing (CI requires it, see above); the reason says what to install.
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"browser tests need a browser: {_missing}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _metric(base: str, name: str, model: str = "pusht") -> float:
    text = _get(f"{base}/metrics")
    match = re.search(rf'^{name}{{model="{model}"}} ([0-9.e+-]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _serve(*extra: str):
    """`streamworld serve` in a subprocess on a free port; yields its base URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamworld",
            "serve",
            "--model",
            "pusht",
            "--model",
            "tiny-wan",
            "--port",
            str(port),
            # The browser shares the cores: one PyTorch thread degrades gracefully there,
            # where spinning OpenMP threads lose whole time slices (docs/benchmarks.md).
            "--threads",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _get(f"{base}/healthz")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the server did not start:\n{proc.stdout.read()}") from None
            time.sleep(0.3)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    yield from _serve()


@pytest.fixture(scope="module")
def token_server():
    """A server that needs a token."""
    yield from _serve("--auth-token", "t0k3n")


@pytest.fixture(scope="module")
def asgi_server():
    """The same server as an ASGI application under uvicorn (`--transport asgi`)."""
    yield from _serve("--transport", "asgi")


# The demo's main paths also run against the ASGI transport (protocol v1 is the same).
BOTH = pytest.mark.parametrize("transport", ["server", "asgi_server"])


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.console_errors = []
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
    page.on("pageerror", lambda e: page.console_errors.append(str(e)))
    yield page
    context.close()


def _stats(page) -> dict:
    return page.evaluate("() => ({...window.streamworld})")


def _wait_frames(page, n: int, timeout_s: float = 60) -> None:
    page.wait_for_function(
        f"() => window.streamworld && window.streamworld.framesShown >= {n}", timeout=timeout_s * 1000
    )


def _stop_and_wait_pages_freed(page, server: str) -> None:
    """Stop, then every K/V page back on the server (none left to a session still running)."""
    page.click("#stop")
    page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)
    deadline = time.monotonic() + 20
    while _metric(server, "streamworld_kv_pages_used") != 0:
        assert time.monotonic() < deadline, "KV pages were not returned after stop"
        time.sleep(0.25)


def _canvas_digest(page) -> str:
    return page.evaluate(
        """() => { const c = document.getElementById('screen');
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let h = 0;
                   for (let i = 0; i < d.length; i += 7) h = (h * 31 + d[i]) >>> 0;
                   return String(h); }"""
    )


def test_page_loads_without_console_errors_and_lists_the_models(server, page):
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    values = page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
    assert values == ["pusht", "tiny-wan"]
    assert page.input_value("#model") == "pusht"  # the server's default model
    assert "pusht" in page.inner_text("#model-info") or "64x64" in page.inner_text("#model-info")
    assert page.console_errors == []


@BOTH
@pytest.mark.parametrize("fmt", ["jpeg", "h264"])
def test_autostart_plays_changing_frames_at_the_stream_rate(request, transport, page, fmt):
    server = request.getfixturevalue(transport)
    page.goto(f"{server}/?autostart=1&format={fmt}&seed=3")
    _wait_frames(page, 4)
    stats = _stats(page)
    assert stats["state"] == "running" and stats["decoder"].startswith(fmt)
    first_digest, shown = _canvas_digest(page), stats["framesShown"]
    # The stream keeps playing: 20 more frames (2 s of video) are shown.
    _wait_frames(page, shown + 20)
    stats = _stats(page)
    assert _canvas_digest(page) != first_digest  # the picture changes
    assert stats["ttffMs"] is not None and stats["errors"] == []
    assert page.console_errors == []


@BOTH
def test_start_button_key_presses_reach_the_server_and_stop_frees_the_kv_cache(request, transport, page):
    server = request.getfixturevalue(transport)
    page.goto(f"{server}/?format=jpeg&seed=5")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    page.click("#start")
    _wait_frames(page, 4)
    start_action = _stats(page)["lastAction"]  # the agent's own position, sent at the start
    assert start_action is not None and _metric(server, "streamworld_kv_pages_used") > 0
    observed = _metric(server, "streamworld_action_to_frame_seconds_count")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
        time.sleep(0.3)
    stats = _stats(page)
    assert stats["lastAction"][0] == pytest.approx(min(512, start_action[0] + 3 * 24), abs=0.2)
    assert stats["lastAction"][1] == pytest.approx(start_action[1], abs=0.2)
    # The server saw the new actions reach frames (its action-to-frame histogram grows).
    deadline = time.monotonic() + 20
    while _metric(server, "streamworld_action_to_frame_seconds_count") <= observed:
        assert time.monotonic() < deadline, "the server never showed a frame for the key presses"
        time.sleep(0.25)
    _stop_and_wait_pages_freed(page, server)
    assert "ended" in page.inner_text("#status")
    assert page.console_errors == []


def test_a_new_scene_while_streaming_replaces_the_session_and_keeps_playing(server, page):
    """The old socket's close must not end the new session (it once did: the handlers read
    the global session), and a key held down sends at most one action a frame."""
    page.goto(f"{server}/?format=jpeg&seed=5")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    page.click("#start")
    _wait_frames(page, 4)
    first = _stats(page)["sessionId"]
    page.click("#new-scene")
    page.wait_for_function(
        f"() => window.streamworld.sessionId && window.streamworld.sessionId !== '{first}'", timeout=60000
    )
    _wait_frames(page, 8)
    time.sleep(1.0)  # the old socket has long closed by now
    stats = _stats(page)
    assert stats["state"] == "running" and stats["errors"] == [], stats
    shown = stats["framesShown"]
    _wait_frames(page, shown + 10)  # still playing
    page.focus("#screen")
    sent = _stats(page)["actionsSent"]
    for _ in range(30):  # a held key: after the first, keydown events with repeat set
        page.keyboard.down("ArrowRight")
    page.keyboard.up("ArrowRight")
    # One action for the press, then at most one a frame (100 ms): far fewer than 30 here.
    assert 1 <= _stats(page)["actionsSent"] - sent < 15
    # A fast drag: moves within one frame are held back, but the drag ends where it ends.
    box = page.locator("#screen").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    for f in (0.3, 0.4, 0.5, 0.6, 0.75):
        page.mouse.move(box["x"] + box["width"] * f, box["y"] + box["height"] * 0.5)
    page.mouse.up()
    assert _stats(page)["lastAction"][0] == pytest.approx(0.75 * 512, abs=2)
    _stop_and_wait_pages_freed(page, server)
    assert page.console_errors == []


def test_a_text_model_takes_a_prompt_and_switches_it_mid_stream(server, page):
    page.goto(f"{server}/?model=tiny-wan&format=jpeg&seed=1")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    assert page.is_visible("#prompt") and not page.is_visible("#new-scene")
    page.fill("#prompt", "a red car")
    page.click("#start")
    _wait_frames(page, 2)
    page.fill("#prompt", "a blue boat")
    page.press("#prompt", "Enter")
    assert _stats(page)["promptsSent"] == 1
    assert "a blue boat" in page.inner_text("#status")
    _wait_frames(page, _stats(page)["framesShown"] + 12)  # the stream goes on after the switch
    assert _stats(page)["errors"] == [] and page.console_errors == []
    page.click("#stop")
    page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)


_LAYOUT = """() => {
  const box = (id) => document.getElementById(id).getBoundingClientRect();
  const c = document.getElementById('screen');
  return {canvas: [c.width, c.height], shown: [box('screen').width, box('screen').height],
          seed: box('seed').width, format: box('format').width, model: box('model').width,
          stats: document.getElementById('st-state').closest('section').getBoundingClientRect().width,
          scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth};
}"""


def _assert_aspect_kept(layout: dict) -> None:
    (w, h), (shown_w, shown_h) = layout["canvas"], layout["shown"]
    assert shown_w >= min(w, 200), f"the video is squashed to {shown_w:.0f} px wide"
    assert shown_w / shown_h == pytest.approx(w / h, rel=0.01), f"{w}x{h} shown as {shown_w}x{shown_h}"


@pytest.mark.parametrize("width", [390, 800, 1024, 1400])
def test_the_layout_keeps_the_video_aspect_ratio_at_every_width(server, browser, width):
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    try:
        page.goto(f"{server}/?format=jpeg&seed=2")
        page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
        idle = page.evaluate(_LAYOUT)
        _assert_aspect_kept(idle)
        page.click("#start")
        _wait_frames(page, 2)
        running = page.evaluate(_LAYOUT)
        _assert_aspect_kept(running)
        assert running["scrollWidth"] <= running["innerWidth"], "the page scrolls sideways"
        # The controls line up, and the stats column keeps its width from idle to running.
        assert running["seed"] == pytest.approx(running["format"], abs=1)
        assert running["format"] == pytest.approx(running["model"], abs=1)
        assert running["stats"] == pytest.approx(idle["stats"], abs=1)
        # A wide stream (480x832, as Wan's) keeps its shape too.
        page.evaluate("() => { const c = document.getElementById('screen'); c.width = 832; c.height = 480; }")
        _assert_aspect_kept(page.evaluate(_LAYOUT))
        page.click("#stop")
        page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)
    finally:
        context.close()


def test_a_server_error_is_shown_and_stale_frames_are_cleared(server, page, tmp_path):
    page.goto(f"{server}/?format=jpeg&seed=4")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    assert not page.is_visible("#error")
    page.click("#start")
    _wait_frames(page, 4)
    page.click("#stop")
    page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)
    last_frame = _canvas_digest(page)
    assert page.inner_text("#st-chunk") != "-"

    bad = tmp_path / "scene.png"
    bad.write_bytes(b"this is not an image")
    page.set_input_files("#image", str(bad))
    page.click("#start")
    page.wait_for_function("() => window.streamworld.errors.length > 0", timeout=20000)
    page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)
    error = page.inner_text("#error")
    assert page.is_visible("#error")
    assert "not a readable PNG or JPEG" in error and "bad_request" in error
    assert "not a readable PNG or JPEG" in page.inner_text("#status")
    assert page.inner_text("#st-chunk") == "-"
    assert _canvas_digest(page) != last_frame  # the old picture is gone

    # The next good start clears the message.
    page.set_input_files("#image", [])
    page.click("#start")
    _wait_frames(page, 2)
    assert not page.is_visible("#error")
    page.click("#stop")
    page.wait_for_function("() => window.streamworld.state === 'idle'", timeout=20000)


_LOG_HAS = "() => document.getElementById('log').textContent.includes('%s')"


def _sent_actions(sent: list) -> list[list[float]]:
    messages = [json.loads(m) for m in sent if isinstance(m, str)]
    return [m["actions"][0] for m in messages if m.get("type") == "action"]


def _protocol_example() -> str:
    """The JavaScript example page of docs/protocol.md, as written there."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    section = doc.split("## JavaScript example (browser)", 1)[1]
    return section.split("```html\n", 1)[1].split("\n```", 1)[0]


def test_the_protocol_docs_javascript_example_plays_and_steers_pusht(server, page):
    html = _protocol_example()
    ws_url = server.replace("http://", "ws://") + "/v1/stream"
    assert 'const SERVER = "ws://127.0.0.1:8123/v1/stream"' in html
    html = html.replace("ws://127.0.0.1:8123/v1/stream", ws_url)
    sent: list[str] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    # The page runs at the server's own origin, as a page the server served would (Chromium
    # blocks pages of unknown origin from opening connections to a local address).
    page.route("**/favicon.ico", lambda route: route.fulfill(status=204))
    page.goto(f"{server}/healthz")
    page.set_content(html)
    page.wait_for_function(
        "() => document.getElementById('log').textContent.includes('chunk 2:')", timeout=60000
    )
    log = page.inner_text("#log")
    assert "started" in log and "pusht" in log and "error" not in log
    lit = page.evaluate(
        """() => { const c = document.getElementById('view');
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let n = 0; for (let i = 0; i < d.length; i += 4) n += d[i] + d[i + 1] + d[i + 2] > 0;
                   return n / (d.length / 4); }"""
    )
    assert lit > 0.5  # frames were drawn
    actions = _sent_actions(sent)
    assert actions, "the page did not hold the agent where the scene puts it"
    start = actions[0]
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    page.wait_for_timeout(300)
    actions = _sent_actions(sent)
    assert actions[-2] == pytest.approx([min(512, start[0] + 24), start[1]])
    assert actions[-1] == pytest.approx([min(512, start[0] + 24), min(512, start[1] + 24)])
    page.keyboard.press("Escape")
    page.wait_for_function(
        "() => document.getElementById('log').textContent.includes('done: stopped')", timeout=30000
    )
    assert page.console_errors == []


def test_the_token_leaves_the_address_bar_and_a_page_without_one_says_it_is_needed(token_server, browser):
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{token_server}/?format=jpeg&token=t0k3n&seed=2&autostart=1")
    _wait_frames(page, 4)
    assert "t0k3n" not in page.url and "seed=2" in page.url  # history keeps the page without it
    page.reload()  # the tab remembers it
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    context.close()
    context = browser.new_context()  # a new visitor without the token
    page = context.new_page()
    page.goto(f"{token_server}/")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('token')")
    assert "?token=" in page.inner_text("#status")
    context.close()
