"""Cluster engines: where pods run. `local` is the embedded default."""
