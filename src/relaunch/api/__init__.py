"""The server: REST API, dashboard and metrics over the store (`relaunch server`)."""

TOKEN_FILE = "server-token"
"""The bearer token's file in the state directory (mode 0600)."""
