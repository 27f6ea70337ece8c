"""The serving side: media encoding (the aiohttp service comes with the server issue)."""
