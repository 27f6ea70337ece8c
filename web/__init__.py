"""The browser demo: static files, installed with the package as `streamworld.web` (see pyproject.toml)."""
