"""Deployment: the deployment file (`config.py`) and Ray Serve (`ray_serve.py`, optional:
`pip install -e ".[ray]"`)."""
