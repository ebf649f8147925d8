"""The API\x27s routers, one per resource."""
