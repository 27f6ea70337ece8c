// StreamWorld browser demo: pick a model, start a session, play the stream, steer it.
//
// Protocol: docs/protocol.md. Frames arrive as `chunk` messages, each followed by one binary
// payload: H.264 access units decoded with WebCodecs, or JPEG files where WebCodecs is
// missing. Frames are shown at the stream's frame rate as soon as they are decoded.
// URL parameters: model, format (auto|h264|jpeg), seed, autostart=1, token (a server's token).

const $ = (id) => document.getElementById(id);
const PUSHT_WORLD = 512; // pusht actions: the agent's target (x, y) in world units, y down
const KEY_STEP = 24; // world units per key press (pusht)
const FPS_WINDOW_MS = 4000; // frames/s is averaged over this long
const KEYS = {
  ArrowUp: "up", KeyW: "up", ArrowDown: "down", KeyS: "down",
  ArrowLeft: "left", KeyA: "left", ArrowRight: "right", KeyD: "right", Space: "stay",
};

// What tests (and curious users) can read: window.streamworld.
const stats = {
  state: "idle", sessionId: null, framesShown: 0, actionsSent: 0, chunks: 0,
  queuePosition: null, ttffMs: null, actionToFrameMs: null, decoder: null, lastAction: null,
  errors: [],
};
window.streamworld = stats;

// A server started with a token: the page's own ?token= is passed on (browsers cannot set an
// Authorization header on a WebSocket). It is taken out of the address bar at once, so that
// it stays out of the browser's history, and kept for this tab only (sessionStorage).
const TOKEN_KEY = "streamworld-token";
const token = takeToken();
const tokenQuery = token ? `?token=${encodeURIComponent(token)}` : "";

function takeToken() {
  const params = new URLSearchParams(location.search);
  if (!params.has("token")) return sessionStorage.getItem(TOKEN_KEY);
  const given = params.get("token");
  sessionStorage.setItem(TOKEN_KEY, given);
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
  return given;
}

let models = [];
let session = null; // the live session, see start()
let starting = false; // start() is reading its inputs: a second Start waits for it
// The server takes text messages of at most 8 MiB, session.start with its base64 image too:
// 6 MiB of file is 8 MiB of base64, so a little less leaves room for the other fields.
const MAX_IMAGE_BYTES = 6 * 1024 * 1024 - 4096;

// --- models -------------------------------------------------------------------------------
async function loadModels() {
  const resp = await fetch(`/v1/models${tokenQuery}`);
  if (resp.status === 401) {
    throw new Error(token ? "the server refused this page's token" : "this server needs a token: open the page with ?token=TOKEN");
  }
  if (!resp.ok) throw new Error(`the server answered ${resp.status}`);
  models = (await resp.json()).models;
  const select = $("model");
  select.replaceChildren(...models.map((m) => new Option(`${m.id}${m.default ? " (default)" : ""}`, m.id)));
  const wanted = new URLSearchParams(location.search).get("model");
  const initial = models.find((m) => m.id === wanted) || models.find((m) => m.default) || models[0];
  if (initial) select.value = initial.id;
  showModel();
}

function currentModel() {
  return models.find((m) => m.id === $("model").value);
}

function isPushT(model) {
  return model && model.environment === "pusht";
}

function showModel() {
  const m = currentModel();
  if (!m) return;
  document.querySelectorAll(".for-prompt").forEach((e) => e.classList.toggle("hidden", !m.takes_prompt));
  document.querySelectorAll(".for-image").forEach((e) => e.classList.toggle("hidden", !m.needs_image));
  document.querySelectorAll(".for-scene").forEach((e) => e.classList.toggle("hidden", !m.has_default_image));
  $("model-info").textContent =
    `${m.width}x${m.height} (width x height) at ${m.fps} fps, ${m.frames_per_chunk} frames per chunk, ` +
    `${m.action_dim ? `actions of ${m.action_dim}` : "no actions"}. ${m.description || ""}`;
  $("help").textContent = isPushT(m)
    ? "Drag on the frame to move the agent's target; arrows or WASD nudge it."
    : m.action_dim
      ? "Arrows or WASD steer (each key sets the action), space resets it."
      : "";
}

// --- decoding -------------------------------------------------------------------------------
async function h264Supported() {
  if (!("VideoDecoder" in window)) return false;
  try {
    const r = await VideoDecoder.isConfigSupported({ codec: "avc1.64001F" });
    return !!r.supported;
  } catch {
    return false;
  }
}

function splitPayload(buffer, sizes) {
  const parts = [];
  let offset = 0;
  for (const size of sizes) {
    parts.push(new Uint8Array(buffer, offset, size));
    offset += size;
  }
  return parts;
}

function isKeyUnit(unit) {
  // Annex-B NAL units: an IDR slice (type 5) or a parameter set before it makes a key unit.
  for (let i = 0; i + 3 < unit.length; i++) {
    if (unit[i] === 0 && unit[i + 1] === 0 && unit[i + 2] === 1) {
      const type = unit[i + 3] & 0x1f;
      if (type === 5 || type === 7) return true;
      if (type === 1) return false;
    }
  }
  return false;
}

class JpegDecoder {
  constructor(onFrame) { this.onFrame = onFrame; this.name = "jpeg (createImageBitmap)"; }
  async decode(buffer, meta) {
    for (const part of splitPayload(buffer, meta.sizes)) {
      const bitmap = await createImageBitmap(new Blob([part], { type: "image/jpeg" }));
      this.onFrame(bitmap);
    }
  }
  close() {}
}

class H264Decoder {
  constructor(codec, fps, onFrame, onError) {
    this.name = `h264 (WebCodecs, ${codec})`;
    this.fps = fps;
    this.frame = 0;
    this.sawKey = false;
    this.decoder = new VideoDecoder({ output: onFrame, error: onError });
    this.decoder.configure({ codec, optimizeForLatency: true });
  }
  async decode(buffer, meta) {
    for (const unit of splitPayload(buffer, meta.sizes)) {
      const key = isKeyUnit(unit);
      if (!this.sawKey && !key) continue; // a decoder must start on a key frame
      this.sawKey = true;
      const timestamp = Math.round((this.frame++ * 1e6) / this.fps);
      this.decoder.decode(new EncodedVideoChunk({ type: key ? "key" : "delta", timestamp, data: unit }));
    }
  }
  close() {
    if (this.decoder.state !== "closed") this.decoder.close();
  }
}

// --- display ------------------------------------------------------------------------------------
class Player {
  constructor(canvas, fps, framesPerChunk) {
    this.maxQueue = Math.max(2, 2 * framesPerChunk);
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.queue = [];
    this.period = 1000 / fps;
    this.next = 0;
    this.shown = []; // when each frame was shown, the last FPS_WINDOW_MS
    this.firstShown = null;
    this.timer = setInterval(() => this.tick(), Math.max(5, this.period / 4));
  }
  push(frame) {
    this.queue.push(frame);
    // Low latency: never let more than two chunks' worth of frames wait.
    while (this.queue.length > this.maxQueue) release(this.queue.shift());
  }
  tick() {
    const now = performance.now();
    if (!this.queue.length || now < this.next) return;
    const frame = this.queue.shift();
    this.ctx.imageSmoothingEnabled = false;
    this.ctx.drawImage(frame, 0, 0, this.canvas.width, this.canvas.height);
    release(frame);
    this.next = Math.max(this.next + this.period, now - this.period);
    this.shown.push(now);
    if (this.firstShown === null) this.firstShown = now;
    stats.framesShown++;
    if (session && session.startedAt && stats.ttffMs === null) stats.ttffMs = now - session.startedAt;
  }
  fps() {
    // Frames shown over the last few seconds (or since the first frame): chunks arrive in
    // bursts, so a short window would swing between a burst's rate and zero.
    if (this.firstShown === null) return null;
    const now = performance.now();
    this.shown = this.shown.filter((t) => now - t < FPS_WINDOW_MS);
    const span = Math.min(FPS_WINDOW_MS, Math.max(now - this.firstShown, 1000));
    return (this.shown.length * 1000) / span;
  }
  close() {
    clearInterval(this.timer);
    this.queue.forEach(release);
    this.queue = [];
  }
}

function release(frame) {
  if (frame && typeof frame.close === "function") frame.close();
}

// --- the session --------------------------------------------------------------------------------
async function readImage() {
  const file = $("image").files[0];
  if (!file) return null;
  if (file.size > MAX_IMAGE_BYTES) throw new Error("the first frame is larger than the server takes (6 MiB)");
  return await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function start() {
  if (session || starting) return;
  starting = true;
  $("start").disabled = true;
  try {
    await open();
  } catch (e) {
    setStatus(`Could not start: ${e.message}`);
  } finally {
    starting = false;
    if (!session) setButtons(false);
  }
}

async function open() {
  const model = currentModel();
  if (!model) return setStatus("No model is served.");
  let format = $("format").value;
  if (format === "auto") format = (await h264Supported()) ? "h264" : "jpeg";
  if (format === "h264" && !(await h264Supported())) {
    setStatus("This browser cannot decode H.264 with WebCodecs; using jpeg.");
    format = "jpeg";
  }
  const message = { type: "session.start", model: model.id, format, priority: "interactive" };
  const seed = $("seed").value.trim();
  if (seed !== "") message.seed = Number(seed);
  if (model.takes_prompt && $("prompt").value.trim()) message.prompt = $("prompt").value.trim();
  if (model.needs_image) {
    const image = await readImage();
    if (image) message.image = image;
    else if (!model.has_default_image) return setStatus(`${model.id} needs a first frame: choose an image.`);
  }

  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/stream${tokenQuery}`);
  ws.binaryType = "arraybuffer";
  // Each socket's handlers hold their own session: one that a newer session replaced is ignored.
  const s = {
    ws, model, format, pending: null, decoder: null, player: null, action: null, decoding: Promise.resolve(),
    startedAt: performance.now(), lastActionAt: null, dragging: false, lastSend: 0, ended: false, doneReason: null,
  };
  session = s;
  Object.assign(stats, {
    state: "connecting", sessionId: null, framesShown: 0, chunks: 0, queuePosition: null,
    ttffMs: null, actionToFrameMs: null, decoder: null, lastAction: null, actionsSent: 0, promptsSent: 0,
  });
  setButtons(true);
  clearError();
  $("st-chunk").textContent = "-";
  drawIdle("Connecting...");
  setStatus("Connecting...");
  ws.onopen = () => ws.send(JSON.stringify(message));
  ws.onmessage = (event) => onMessage(s, event).catch((e) => s === session && fail(`client error: ${e.message}`));
  ws.onclose = (event) => onClose(s, event);
}

async function onMessage(s, event) {
  if (s !== session) return;
  if (typeof event.data !== "string") {
    const meta = s.pending;
    s.pending = null;
    if (!meta || !s.decoder) return;
    noteActionLatency(s, meta);
    // One chunk at a time, in order: frames of two chunks decoding at once would interleave.
    const decoder = s.decoder;
    if (s.failure) return;
    s.decoding = s.decoding.then(() => (s === session ? decoder.decode(event.data, meta) : undefined));
    await s.decoding;
    return;
  }
  const msg = JSON.parse(event.data);
  switch (msg.type) {
    case "session.queued":
      stats.state = "queued";
      stats.queuePosition = msg.position;
      setStatus(`Queued: position ${msg.position}`);
      break;
    case "session.started":
      onStarted(s, msg);
      break;
    case "chunk":
      s.pending = msg;
      stats.chunks++;
      $("st-chunk").textContent = `chunk ${msg.index}: frames ${msg.first_frame}-${msg.first_frame + msg.num_frames - 1}\n` +
        Object.entries(msg.timings).map(([k, v]) => `${k} ${v}`).join("\n");
      break;
    case "error":
      stats.errors.push(msg);
      if (msg.code === "bad_request" && stats.state === "running") {
        // The session goes on (a message it refused): say so, and keep the stream.
        showError(`The server refused a message (the session goes on): ${msg.message}`);
        break;
      }
      s.serverError = msg;
      showError(`Server error (${msg.code}): ${msg.message}`);
      setStatus(`Server: ${msg.code}: ${msg.message}`);
      break;
    case "session.done":
      s.ended = true;
      s.doneReason = msg.reason;
      if (msg.reason !== "error") setStatus(`Session ended (${msg.reason}) after ${msg.chunks} chunks.`);
      s.ws.close(1000);
      break;
    default:
      break; // pong and future message types
  }
}

function onStarted(s, msg) {
  stats.state = "running";
  stats.sessionId = msg.session_id;
  stats.queuePosition = null;
  const canvas = $("screen");
  const scale = Math.max(1, Math.floor(512 / Math.max(msg.width, msg.height)));
  canvas.width = msg.width * scale;
  canvas.height = msg.height * scale;
  s.fps = msg.fps;
  s.player = new Player(canvas, msg.fps, msg.frames_per_chunk || 12);
  const onFrame = (frame) => (s === session && s.player ? s.player.push(frame) : release(frame));
  s.decoder = msg.format === "h264"
    ? new H264Decoder(msg.codec, msg.fps, onFrame, (e) => s === session && fail(`decoder: ${e.message}`))
    : new JpegDecoder(onFrame);
  stats.decoder = s.decoder.name;
  setStatus(`Streaming ${msg.model} (seed ${msg.seed}, ${msg.kv_mode} KV).`);
  if (s.model.action_dim) {
    if (isPushT(s.model)) {
      const agent = msg.scene && msg.scene.agent;
      // Start by holding the agent where it is (the hold policy would otherwise use zeros).
      sendAction(s, agent ? [agent[0], agent[1]] : [PUSHT_WORLD / 2, PUSHT_WORLD / 2]);
    } else {
      s.action = new Array(s.model.action_dim).fill(0);
    }
  }
  canvas.focus();
}

function noteActionLatency(s, meta) {
  // A chunk that started after the last action is the first one that can show it.
  if (s.lastActionAt === null || !meta.timings) return;
  const now = performance.now();
  const startedAt = now - (meta.timings.total + meta.timings.queued);
  if (startedAt >= s.lastActionAt) {
    stats.actionToFrameMs = now - s.lastActionAt;
    s.lastActionAt = null;
  }
}

function sendAction(s, vector) {
  if (!s || s.ws.readyState !== WebSocket.OPEN || stats.state !== "running") return;
  s.action = vector;
  s.ws.send(JSON.stringify({ type: "action", actions: [vector] }));
  stats.actionsSent++;
  stats.lastAction = vector.map((v) => Math.round(v * 10) / 10);
  if (s.lastActionAt === null) s.lastActionAt = performance.now();
}

function onKey(event) {
  const s = session;
  const dir = KEYS[event.code];
  if (!s || !dir || !s.model.action_dim || stats.state !== "running") return;
  if (event.target instanceof HTMLInputElement || event.target instanceof HTMLSelectElement) return;
  event.preventDefault();
  // A held key repeats about 30 times a second: at most one action a frame, or the actions
  // would queue ever further ahead of the frames.
  const now = performance.now();
  if (event.repeat && now - s.lastSend < 1000 / (s.fps || 10)) return;
  s.lastSend = now;
  let v = [...(s.action || new Array(s.model.action_dim).fill(0))];
  if (isPushT(s.model)) {
    const d = { up: [0, -KEY_STEP], down: [0, KEY_STEP], left: [-KEY_STEP, 0], right: [KEY_STEP, 0], stay: [0, 0] }[dir];
    v = [clamp(v[0] + d[0], 0, PUSHT_WORLD), clamp(v[1] + d[1], 0, PUSHT_WORLD)];
  } else if (dir === "stay") {
    v = v.map(() => 0);
  } else if (dir === "left" || dir === "right") {
    v[0] = dir === "left" ? -1 : 1;
  } else if (v.length > 1) {
    v[1] = dir === "up" ? 1 : -1;
  }
  sendAction(s, v);
}

function onPointer(event) {
  const s = session;
  if (!s || !isPushT(s.model) || stats.state !== "running") return;
  if (event.type === "pointerdown") s.dragging = true;
  if (event.type === "pointerup" || event.type === "pointerleave") {
    // The drag ends where the pointer is: send the last position the throttle held back.
    if (s.dragging && s.heldBack) sendAction(s, s.heldBack);
    s.dragging = false;
    s.heldBack = null;
    return;
  }
  if (!s.dragging) return;
  const rect = event.currentTarget.getBoundingClientRect();
  const x = clamp(((event.clientX - rect.left) / rect.width) * PUSHT_WORLD, 0, PUSHT_WORLD);
  const y = clamp(((event.clientY - rect.top) / rect.height) * PUSHT_WORLD, 0, PUSHT_WORLD);
  const now = performance.now();
  if (event.type === "pointermove" && now - s.lastSend < 1000 / (s.fps || 10)) {
    s.heldBack = [x, y]; // one action a frame
    return;
  }
  s.lastSend = now;
  s.heldBack = null;
  sendAction(s, [x, y]);
}

function onPromptKey(event) {
  // Enter in the prompt box switches the prompt of a running session (from the next chunk).
  const s = session;
  if (event.key !== "Enter" || !s || !s.model.takes_prompt || stats.state !== "running") return;
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  s.ws.send(JSON.stringify({ type: "prompt", prompt }));
  stats.promptsSent = (stats.promptsSent || 0) + 1;
  setStatus(`Prompt switched to "${prompt}" from the next chunk.`);
}

function stop() {
  const s = session;
  if (!s) return;
  if (s.ws.readyState === WebSocket.OPEN && stats.state === "running") {
    stats.state = "stopping";
    s.ws.send(JSON.stringify({ type: "session.stop" }));
    setTimeout(() => {
      if (s !== session) return;
      s.ended = true; // a Stop, however the close ends
      s.ws.close(1000);
    }, 3000);
  } else {
    s.ended = true;
    s.ws.close(1000);
  }
}

const CLOSE_MEANINGS = {
  1001: "the server is shutting down",
  1006: "the connection dropped, or the server could not be reached",
  1008: "the server refused a message",
  1009: "a message was too large",
  1011: "the server hit an internal error",
  1013: "the server is full; try again shortly",
};

function onClose(s, event) {
  if (s !== session) return;
  if (s.failure) return finish(s.failure);
  if (s.doneReason === "error") {
    const why = s.serverError ? `${s.serverError.code}: ${s.serverError.message}` : "the session ended in error";
    return finish(`Session failed: ${why}`);
  }
  if (event.code === 1000 || s.ended) return finish(null);
  // The server says why in an `error` message before it closes; show that, else the close code.
  const why = s.serverError
    ? `${s.serverError.code}: ${s.serverError.message}`
    : `connection closed (${event.code}${event.reason ? `: ${event.reason}` : ""})` +
      (CLOSE_MEANINGS[event.code] ? `: ${CLOSE_MEANINGS[event.code]}` : "");
  if (!s.serverError) showError(why);
  finish(`Session failed: ${why}`);
}

function finish(problem) {
  const s = session;
  if (!s) return;
  session = null;
  if (s.player) s.player.close();
  if (s.decoder) s.decoder.close();
  stats.state = "idle";
  stats.queuePosition = null;
  setButtons(false);
  if (problem) {
    // Nothing stale stays on screen after a failure: no last frame, no last chunk.
    $("st-chunk").textContent = "-";
    drawIdle("The session failed: see the message above.");
    setStatus(problem);
  } else if (!s.doneReason) {
    // Stopped before the server said the session was done (while connecting or queued, or
    // the stop went unanswered): no stale "Connecting..." or "Streaming".
    setStatus("Stopped.");
    if (!stats.framesShown) drawIdle("Press Start");
  }
}

function fail(message) {
  if (session && session.failure) return; // the first cause is the one to report
  stats.errors.push({ code: "client", message });
  showError(message);
  setStatus(message);
  if (session) {
    session.failure = message; // what onClose reports once the socket has closed
    session.ws.close(1000);
  }
}

function newScene() {
  if (starting) return;
  $("seed").value = String(Math.floor(Math.random() * 1e9));
  if (session) {
    const s = session;
    s.ended = true;
    s.ws.close(1000);
    finish(null);
  }
  start();
}

// --- page -------------------------------------------------------------------------------------
function clamp(v, lo, hi) { return Math.min(hi, Math.max(lo, v)); }
function setStatus(text) { $("status").textContent = text; }
function showError(text) {
  $("error").textContent = text;
  $("error").classList.remove("hidden");
}
function clearError() {
  $("error").textContent = "";
  $("error").classList.add("hidden");
}

function drawIdle(text) {
  // The canvas before and between sessions: a neutral card that says what to do.
  const canvas = $("screen");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.fillStyle = "#2a3040";
  ctx.fillRect(0, 0, width, height);
  ctx.strokeStyle = "#39415a";
  ctx.lineWidth = 1;
  const step = Math.max(16, Math.round(width / 16));
  for (let x = step; x < width; x += step) line(ctx, x, 0, x, height);
  for (let y = step; y < height; y += step) line(ctx, 0, y, width, y);
  ctx.fillStyle = "#d8dce6";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  ctx.font = `${Math.max(12, Math.round(width / 22))}px system-ui, sans-serif`;
  ctx.fillText(text, width / 2, height / 2);
}

function line(ctx, x0, y0, x1, y1) {
  ctx.beginPath();
  ctx.moveTo(x0 + 0.5, y0 + 0.5);
  ctx.lineTo(x1 + 0.5, y1 + 0.5);
  ctx.stroke();
}
function setButtons(running) {
  $("start").disabled = running;
  $("stop").disabled = !running;
  $("model").disabled = running;
  $("format").disabled = running;
}

function renderStats() {
  $("st-state").textContent = stats.state;
  $("st-queue").textContent = stats.queuePosition ?? "-";
  const fps = session && session.player ? session.player.fps() : null;
  $("st-fps").textContent = fps === null ? "-" : fps.toFixed(1);
  $("st-ttff").textContent = stats.ttffMs === null ? "-" : `${(stats.ttffMs / 1000).toFixed(2)} s`;
  $("st-a2f").textContent = stats.actionToFrameMs === null ? "-" : `${Math.round(stats.actionToFrameMs)} ms`;
  $("st-frames").textContent = stats.framesShown;
  $("st-decoder").textContent = stats.decoder ?? "-";
  $("st-action").textContent = stats.lastAction ? JSON.stringify(stats.lastAction) : "-";
}

async function main() {
  const params = new URLSearchParams(location.search);
  const format = params.get("format");
  if (format && [...$("format").options].some((o) => o.value === format)) $("format").value = format;
  if (params.get("seed")) $("seed").value = params.get("seed");
  $("model").addEventListener("change", showModel);
  $("start").addEventListener("click", start);
  $("stop").addEventListener("click", stop);
  $("new-scene").addEventListener("click", newScene);
  document.addEventListener("keydown", onKey);
  $("prompt").addEventListener("keydown", onPromptKey);
  for (const type of ["pointerdown", "pointermove", "pointerup", "pointerleave"]) {
    $("screen").addEventListener(type, onPointer);
  }
  window.addEventListener("pagehide", () => session && session.ws.close(1000));
  setInterval(renderStats, 250);
  drawIdle("Press Start");
  await loadModels();
  if (params.get("autostart") === "1") start();
}

main().catch((e) => setStatus(`Could not load the models: ${e.message}`));
