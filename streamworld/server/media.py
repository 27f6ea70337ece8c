"""Temporary re-export: the media code moved to `streamworld.media`.

The server's modules still import these names from here; once their imports read
`from ..media import ...`, this file goes.
"""

from ..media import FORMATS, EncodedChunk, make_encoder, write_mp4

__all__ = ["FORMATS", "EncodedChunk", "make_encoder", "write_mp4"]
