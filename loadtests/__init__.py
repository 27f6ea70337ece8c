"""StreamWorld's load generator, a WebSocket client of a running server (`loadtests/README.md`).

`run.py` is the command line and the import surface; `plan`, `viewer`, `report` and
`server_http` are its parts. Nothing here imports the server.
"""
