"""The server's own settings and what it serves: `ServerConfig`, `SessionLimits`, `ServedModel`.

Engine settings live in `EngineConfig`; these are the limits the server applies on top (text
frame size, connections, start and queue timeouts, backpressure, shutdown grace), who may
connect (origins, token), and the model-plus-engine pairs it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine import ReplicaSet
from ..models.world_model import WorldModel
from ..scenes import FirstFrame

# Enough for a base64 first frame.
DEFAULT_MAX_TEXT_FRAME = 8 * 1024 * 1024


@dataclass(frozen=True)
class SessionLimits:
    start_timeout_s: float = 30.0
    pause_chunks: int = 2
    slow_client_timeout_s: float = 10.0
    # Chunks a client that sends acks may hold unacknowledged before its clock pauses.
    ack_window: int = 3
    # Seconds a session may wait in the admission queue before it is refused as overloaded.
    queue_timeout_s: float = 60.0


@dataclass(frozen=True)
class ServerConfig:
    max_text_frame: int = DEFAULT_MAX_TEXT_FRAME
    encode_threads: int = 2
    limits: SessionLimits = field(default_factory=SessionLimits)
    shutdown_grace_s: float = 5.0
    # Open WebSocket connections (started or not); upgrades beyond it get HTTP 503.
    max_connections: int = 256
    # Browser origins allowed besides the server's own ("*": any); see docs/security.md.
    allowed_origins: tuple[str, ...] = ()
    # A shared secret required on /v1/stream, /v1/models and /metrics; None: no token needed.
    auth_token: str | None = field(default=None, repr=False)
    # Which server this is, where several serve one address (a Ray Serve replica's id):
    # given in session.started and /healthz. None: not given.
    instance: str | None = None


@dataclass
class ServedModel:
    model: WorldModel  # the first replica's (every replica has the same configuration)
    engine: ReplicaSet  # one engine per replica, as one pool
    # Image-to-world models: the first frame used when a session gives none (by seed).
    first_frame: FirstFrame | None = None

    def default_image(self, seed: int) -> tuple[np.ndarray, dict[str, Any] | None] | None:
        return None if self.first_frame is None else self.first_frame(seed)
