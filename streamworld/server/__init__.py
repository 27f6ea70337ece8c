"""The serving side: one aiohttp application that serves the browser demo, health, metrics,
the model list and one WebSocket stream per connection over the engine.

    config     ServerConfig, SessionLimits, ServedModel
    app        routes and lifecycle; builds sessions from a narrow SessionContext
    session    the state machine of one stream, over a StreamHandle only
    pacing     backpressure: outgoing bound, send timeout, ack window and its watchdog
    protocol   close codes, parsing client messages, building server messages
    metrics    Prometheus metrics

The video payloads' wire formats are in `streamworld.media`, shared with the client.
"""

from .app import StreamWorldServer
from .config import ServerConfig, SessionLimits

__all__ = ["ServerConfig", "SessionLimits", "StreamWorldServer"]
