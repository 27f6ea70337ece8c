"""Wire formats in both directions: chunk encoders (server) and chunk decoders (client).

| module | owns |
| --- | --- |
| `formats` | the format names, `EncodedChunk`, frame and `sizes` checks shared by both sides |
| `annexb` | H.264 NAL units in Annex-B byte streams and as length-prefixed MP4 samples |
| `x264` | one zero-latency libx264 encoder per session |
| `fmp4` | fragmented-MP4 boxes: writing init segments and fragments, reading them back |
| `encoders` | `make_encoder` and the encoder of each format |
| `decoders` | `make_decoder` and the decoder of each format |
| `mp4_file` | whole clips to MP4 files |

This package sits below `server/` and the client and imports neither, nor `engine/`.
"""

from .decoders import ChunkDecoder, make_decoder
from .encoders import (
    DEFAULT_CRF,
    DEFAULT_JPEG_QUALITY,
    DEFAULT_KEYFRAME_INTERVAL_S,
    ChunkEncoder,
    make_encoder,
)
from .formats import FORMATS, SIZED_FORMATS, EncodedChunk
from .mp4_file import write_mp4

__all__ = [
    "DEFAULT_CRF",
    "DEFAULT_JPEG_QUALITY",
    "DEFAULT_KEYFRAME_INTERVAL_S",
    "FORMATS",
    "SIZED_FORMATS",
    "ChunkDecoder",
    "ChunkEncoder",
    "EncodedChunk",
    "make_decoder",
    "make_encoder",
    "write_mp4",
]
