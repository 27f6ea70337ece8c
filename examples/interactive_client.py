"""Terminal client for StreamWorld: stream one session, steer it with actions, save the video as an mp4.

Connects to a running server (`streamworld serve`), starts a session and writes every frame it receives
to an mp4 (`--out`), printing one line per chunk: its index, its frames, the server's time for it and the
client-side time since the previous chunk. Actions come from a JSON file (`--actions`), from the keyboard
(`--keyboard`: arrows or WASD move, space stays, q quits), or not at all. Ctrl-C (or q) stops cleanly:
the session is stopped, the chunks already under way are received, and the mp4 is written.

    streamworld serve --model pusht --model tiny-wan                      # in another terminal
    python examples/interactive_client.py --keyboard                      # pusht, from its seed's scene
    python examples/interactive_client.py --seed 3 --actions moves.json --out moves.mp4
    python examples/interactive_client.py --model tiny-wan --chunks 2 --out /tmp/x.mp4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np
from PIL import Image
from websockets.exceptions import WebSocketException

from streamworld.client import FORMATS, Chunk, SessionInfo, StreamWorldClient, StreamWorldError
from streamworld.media import write_mp4

DEFAULT_URL = "ws://127.0.0.1:8000/v1/stream"
MIN_VIDEO_SIDE = 256  # the written mp4 is enlarged to at least this (see --scale)
DRAIN_S = 5.0  # after a stop, how long to wait for the chunks already under way
PUSHT_WORLD = 512.0  # pusht actions are agent targets (x, y) in world units [0, 512], y down
ARROWS = {b"A": "up", b"B": "down", b"C": "right", b"D": "left"}  # after ESC [
LETTERS = {b"w": "up", b"s": "down", b"a": "left", b"d": "right", b" ": "stay", b"q": "quit", b"\x03": "quit"}
ACTIONS_HELP = (
    'per-frame action vectors: a JSON list of lists, or {"actions": [[...], ...]}; all are sent at the start '
    "for frames 0, 1, ... and chunks wait for their actions (policy wait); without --chunks the session "
    "stops once they are used up"
)
KEY_HELP = """keyboard (--keyboard): arrows or WASD move, space stays, q quits. For `pusht` (action = the
agent target (x, y) in world units [0, 512], y down) each key moves the target by --step from the agent's
start (or the centre); for other models left/right set action[0] to -1/+1, up/down set action[1] to +1/-1
and space resets all to 0. An action is sent only when it changes: the hold policy repeats it until the
next one."""


class Exit(Exception):
    """Ends the program with a one-line error: code 2 for bad arguments, 1 for everything else."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = Parser(
        prog="interactive_client.py",
        description=__doc__,
        epilog=KEY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--url", default=DEFAULT_URL, help="the server's WebSocket endpoint (default %(default)s)")
    add("--model", help="model id from /v1/models (default: the server's default model)")
    add("--seed", type=int, help="noise seed (default: the server picks one; it is printed)")
    add("--image", metavar="PNG", help="first frame, for image-to-world models such as pusht")
    add("--prompt", help="text prompt, for models that take one")
    add("--format", choices=FORMATS, default="jpeg", help="wire format, all decoded here (default jpeg)")
    add("--kv-mode", choices=("clean", "final", "noisy"), help="K/V cache mode (default: the model's)")
    add("--chunks", type=int, metavar="N", help="chunks to generate (default: until stopped)")
    add("--actions", metavar="FILE.json", help=ACTIONS_HELP)
    add("--keyboard", action="store_true", help="steer from the terminal with the keys below (needs a TTY)")
    add("--hold", action="store_true", help="with --actions: hold policy (the last action repeats), not wait")
    add("--step", type=float, default=24.0, help="--keyboard with pusht: world units per key (default 24)")
    add("--out", default="stream.mp4", help="the mp4 to write (default %(default)s)")
    add(
        "--scale",
        type=int,
        metavar="N",
        help="enlarge each frame N times in the mp4, pixel for pixel (default: the least that makes "
        f"the shorter side at least {MIN_VIDEO_SIDE} px, e.g. 4 for pusht's 64x64)",
    )
    args = p.parse_args(argv)
    if args.chunks is not None and args.chunks < 1:
        p.error(f"--chunks must be at least 1, got {args.chunks}")
    if args.scale is not None and args.scale < 1:
        p.error(f"--scale must be at least 1, got {args.scale}")
    if args.step <= 0:
        p.error(f"--step must be positive, got {args.step:g}")
    if args.actions and args.keyboard:
        p.error("--actions and --keyboard exclude each other")
    if args.hold and not args.actions:
        p.error("--hold applies only with --actions")
    if urlsplit(args.url).scheme not in ("ws", "wss") or not urlsplit(args.url).netloc:
        p.error(f"--url must be a ws:// or wss:// URL, got {args.url!r}")
    if args.keyboard and not sys.stdin.isatty():
        p.error("--keyboard reads keys from the terminal, but stdin is not a TTY")
    return args


MAX_ACTIONS_FILE_BYTES = 64 * 2**20  # millions of vectors, far beyond any session


def load_actions(path: str) -> np.ndarray:
    try:
        if os.path.getsize(path) > MAX_ACTIONS_FILE_BYTES:
            raise Exit(f"--actions {path} is larger than 64 MiB", 2)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise Exit(f"cannot read --actions {path}: {e.strerror}", 2) from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, integers too long, too deep
        raise Exit(f"--actions {path} is not valid JSON: {str(e)[:200]}", 2) from None
    if isinstance(data, dict):
        data = data.get("actions")
    try:
        actions = np.asarray(data, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        actions = np.zeros((0, 0))
    if actions.ndim != 2 or actions.size == 0 or not np.isfinite(actions).all():
        raise Exit(f"--actions {path} must hold a non-empty list of equal-length lists of numbers", 2)
    return actions


def load_image(path: str) -> np.ndarray:
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise Exit(f"cannot read --image {path}: {e}", 2) from None


async def fetch_model(args: argparse.Namespace) -> dict[str, Any]:
    """The /v1/models entry of the model the session will get."""
    parts = urlsplit(args.url)
    url = urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, "/v1/models", "", ""))
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url) as response,
        ):
            response.raise_for_status()
            models = (await response.json())["models"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
        raise Exit(f"cannot get the model list from {url}: {str(e) or type(e).__name__}") from None
    if args.model is None:
        return next((m for m in models if m.get("default")), models[0])
    for model in models:
        if model.get("id") == args.model:
            return model
    served = ", ".join(str(m.get("id")) for m in models)
    raise Exit(f"the server does not serve model {args.model!r} (it serves: {served})", 2)


def check_options(model: dict[str, Any], args: argparse.Namespace, actions: np.ndarray | None) -> None:
    name, dim = model["id"], int(model.get("action_dim", 0))
    if dim == 0 and (args.actions or args.keyboard):
        option = "--actions" if args.actions else "--keyboard"
        raise Exit(f"model {name} takes no actions (action_dim 0): drop {option}", 2)
    if actions is not None and actions.shape[1] != dim:
        raise Exit(f"--actions vectors have {actions.shape[1]} entries, model {name} takes {dim}", 2)
    if model.get("needs_image") and args.image is None and not model.get("has_default_image"):
        raise Exit(f"model {name} needs a first frame: pass --image PNG", 2)
    if dim > 0 and actions is None and not args.keyboard:
        print(f"note: no actions given; {name} frames use the hold policy's zero actions", file=sys.stderr)


class KeyMap:
    """The session's current action vector, changed by key names (up, down, left, right, stay)."""

    def __init__(self, environment: str | None, action_dim: int, scene: Any, step: float) -> None:
        self.pusht = environment == "pusht"  # `environment` in the model's /v1/models entry
        self.step = step
        agent = scene.get("agent") if isinstance(scene, dict) else None
        if self.pusht:
            start = agent[:2] if isinstance(agent, list) and len(agent) >= 2 else [PUSHT_WORLD / 2] * 2
            self.vector = np.clip(np.asarray(start, dtype=np.float64), 0, PUSHT_WORLD)
        else:
            self.vector = np.zeros(action_dim)

    def press(self, key: str) -> bool:
        """Applies one key; whether the vector changed."""
        before = self.vector.copy()
        if self.pusht:
            dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}.get(key, (0, 0))
            self.vector = np.clip(self.vector + self.step * np.array([dx, dy]), 0, PUSHT_WORLD)
        elif key == "stay":
            self.vector[:] = 0
        elif key in ("left", "right"):
            self.vector[0] = -1 if key == "left" else 1
        elif key in ("up", "down") and self.vector.size > 1:
            self.vector[1] = 1 if key == "up" else -1
        return not np.array_equal(before, self.vector)


def parse_keys(buffer: bytearray) -> list[str]:
    """Takes the complete keys off the front of `buffer`; an unfinished escape sequence stays in it."""
    keys = []
    while buffer:
        if buffer[:1] == b"\x1b" and (len(buffer) == 1 or buffer[1:2] == b"["):
            if len(buffer) < 3:
                break
            key = ARROWS.get(bytes(buffer[2:3]))
            del buffer[:3]
        else:
            key = LETTERS.get(bytes(buffer[:1]).lower())
            del buffer[:1]
        if key is not None:
            keys.append(key)
    return keys


@contextlib.contextmanager
def cbreak_terminal(fd: int) -> Any:
    """Unbuffered, unechoed key input; cbreak rather than full raw mode so that Ctrl-C stays a SIGINT."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def send_loop(client: StreamWorldClient, queue: asyncio.Queue[np.ndarray]) -> None:
    """Sends the keyboard's action vectors in order, each to follow the last queued action."""
    while True:
        vector = await queue.get()
        try:
            await client.send_actions([vector.tolist()])
        except StreamWorldError:
            return  # the session is over; the receiver reports why


async def receive(client: StreamWorldClient, frames: list[np.ndarray], on_chunk: Any) -> None:
    previous, errors_seen = time.monotonic(), 0
    async for chunk in client.chunks():
        frames.append(chunk.frames)
        total = chunk.timings.get("total")
        server = "n/a" if total is None else f"{total:.1f} ms"
        last = chunk.first_frame + chunk.num_frames - 1
        print(
            f"chunk {chunk.index:4d}  {chunk.num_frames:3d} frames ({chunk.first_frame}-{last})  "
            f"server {server:>10}  client +{(chunk.received_at - previous) * 1000:.0f} ms",
            flush=True,
        )
        previous = chunk.received_at
        for error in client.errors[errors_seen:]:
            print(f"server error: {error}", file=sys.stderr)
        errors_seen = len(client.errors)
        on_chunk(chunk)


@dataclass
class Recording:
    frames: list[np.ndarray] = field(default_factory=list)
    fps: float | None = None  # set once the session has started


def open_client(args: argparse.Namespace, image: np.ndarray | None, wait: bool) -> StreamWorldClient:
    return StreamWorldClient(
        args.url,
        model=args.model,
        prompt=args.prompt,
        image=image,
        seed=args.seed,
        num_chunks=args.chunks,
        format=args.format,
        kv_mode=args.kv_mode,
        action_policy="wait" if wait else None,
        priority="interactive" if args.keyboard else None,
        on_queued=lambda position: print(f"queued: position {position}", file=sys.stderr),
    )


def stop_on_sigint(stop: asyncio.Event, cleanup: contextlib.AsyncExitStack) -> None:
    """Ctrl-C sets `stop` instead of interrupting, so that the session ends cleanly."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows: Ctrl-C raises
        loop.add_signal_handler(signal.SIGINT, stop.set)
        cleanup.callback(loop.remove_signal_handler, signal.SIGINT)


async def started_session(
    starting: asyncio.Future[SessionInfo], stopping: asyncio.Future[Any], url: str
) -> SessionInfo | None:
    """The session once it has started; None if a stop came first."""
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        print("stopped before the session started", file=sys.stderr)
        return None
    try:
        info = starting.result()
    except StreamWorldError as e:
        raise Exit(f"the session did not start: {e}") from None
    except (OSError, asyncio.TimeoutError, WebSocketException) as e:
        raise Exit(f"cannot connect to {url}: {str(e) or type(e).__name__}") from None
    return info


def announce(info: SessionInfo) -> None:
    print(
        f"session {info.session_id}: {info.model} {info.width}x{info.height} @ {info.fps:g} fps, "
        f"{info.format}, kv {info.kv_mode}, seed {info.raw.get('seed')}; Ctrl-C stops",
        file=sys.stderr,
    )


def stop_when_actions_run_out(
    args: argparse.Namespace, info: SessionInfo, actions: np.ndarray | None, wait: bool, stop: asyncio.Event
) -> Callable[[Chunk], None]:
    """The chunk callback that stops a session run by --actions (without --chunks) once they are used up."""

    def on_chunk(chunk: Chunk) -> None:
        # With wait, the next chunk (frames up to last + frames_per_chunk) needs actions up to the
        # frame before its last one; once the file has none for it, the stream is over.
        last = chunk.first_frame + chunk.num_frames - 1
        if wait and args.chunks is None and last + info.frames_per_chunk > len(actions):
            print(f"all {len(actions)} actions are used up: stopping", file=sys.stderr)
            stop.set()

    return on_chunk


def steer_from_keyboard(
    client: StreamWorldClient,
    keys: KeyMap,
    stop: asyncio.Event,
    cleanup: contextlib.AsyncExitStack,
) -> None:
    """Puts the terminal in cbreak mode and sends an action whenever a key changes it, until cleanup."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    cleanup.enter_context(cbreak_terminal(fd))
    queue: asyncio.Queue[np.ndarray] = asyncio.Queue()
    cleanup.callback(asyncio.ensure_future(send_loop(client, queue)).cancel)
    if keys.pusht:
        queue.put_nowait(keys.vector.copy())  # the initial target
        print(f"action {keys.vector.tolist()} (the start)", file=sys.stderr)
    buffer = bytearray()

    def on_key() -> None:
        data = os.read(fd, 64)
        if not data:  # the terminal went away
            loop.remove_reader(fd)
        buffer.extend(data)
        for key in parse_keys(buffer):
            if key == "quit":
                stop.set()
            elif keys.press(key):
                queue.put_nowait(keys.vector.copy())
                print(f"action {np.round(keys.vector, 2).tolist()}", file=sys.stderr)

    loop.add_reader(fd, on_key)
    cleanup.callback(loop.remove_reader, fd)
    print("keys: arrows/WASD move, space stays, q quits", file=sys.stderr)


async def finish(
    client: StreamWorldClient, receiver: asyncio.Task[None], stopping: asyncio.Future[Any]
) -> int:
    """Waits for the session to end, or on a stop stops it and receives the chunks under way."""
    await asyncio.wait({receiver, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not receiver.done():
        print(f"stopping: waiting up to {DRAIN_S:g} s for the chunks under way", file=sys.stderr)
        with contextlib.suppress(StreamWorldError):
            await client.stop()
        if not (await asyncio.wait({receiver}, timeout=DRAIN_S))[0]:
            print("the session did not end in time: closing", file=sys.stderr)
            receiver.cancel()
            return 0
    if receiver.exception() is not None:
        raise Exit(f"the session failed: {receiver.exception()}")
    print(f"session done: {client.done_reason}, {client.chunks_done} chunks", file=sys.stderr)
    return 0


async def stream(
    args: argparse.Namespace,
    model: dict[str, Any],
    actions: np.ndarray | None,
    image: np.ndarray | None,
    recording: Recording,
) -> int:
    wait = actions is not None and not args.hold
    client = open_client(args, image, wait)
    stop = asyncio.Event()
    # Undone in reverse order on the way out: the client closes last, after the keyboard is released.
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.push_async_callback(client.close)
        stop_on_sigint(stop, cleanup)
        starting = asyncio.ensure_future(client.start())
        stopping = asyncio.ensure_future(stop.wait())
        cleanup.callback(stopping.cancel)
        info = await started_session(starting, stopping, args.url)
        if info is None:
            return 0
        recording.fps = info.fps
        announce(info)
        on_chunk = stop_when_actions_run_out(args, info, actions, wait, stop)
        if actions is not None:
            await client.send_actions(actions, frame=0)
        if args.keyboard:
            action_dim = int(model.get("action_dim", 0))
            keys = KeyMap(model.get("environment"), action_dim, info.raw.get("scene"), args.step)
            steer_from_keyboard(client, keys, stop, cleanup)
        receiver = asyncio.create_task(receive(client, recording.frames, on_chunk))
        return await finish(client, receiver, stopping)


def upscale(video: np.ndarray, scale: int | None) -> np.ndarray:
    """[T, H, W, 3] enlarged `scale` times by repeating pixels (players smear tiny videos)."""
    if scale is None:
        scale = max(1, -(-MIN_VIDEO_SIDE // min(video.shape[1:3])))
    return video if scale == 1 else video.repeat(scale, axis=1).repeat(scale, axis=2)


def save(recording: Recording, path: str, scale: int | None = None) -> bool:
    """Writes what was received; whether that went well (or there was nothing to write)."""
    if recording.fps is None:
        return True  # the session never started
    if not recording.frames:
        print("no frames received: no mp4 written", file=sys.stderr)
        return True
    video = upscale(np.concatenate(recording.frames), scale)
    try:
        write_mp4(video, path, fps=max(1, round(recording.fps)))
    except (OSError, ValueError) as e:
        print(f"error: cannot write {path}: {e}", file=sys.stderr)
        return False
    print(f"wrote {path}: {len(video)} frames, {video.shape[2]}x{video.shape[1]} at {recording.fps:g} fps")
    return True


async def run(args: argparse.Namespace) -> int:
    actions = load_actions(args.actions) if args.actions else None
    image = load_image(args.image) if args.image else None
    model = await fetch_model(args)
    check_options(model, args, actions)
    recording = Recording()
    try:
        code = await stream(args, model, actions, image, recording)
    except Exit as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.code
    except StreamWorldError as e:  # the connection ended while sending
        print(f"error: the session failed: {e}", file=sys.stderr)
        code = 1
    return code if save(recording, args.out, args.scale) else max(code, 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except Exit as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # only where no SIGINT handler could be installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
