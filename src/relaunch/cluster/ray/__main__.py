"""`python -m relaunch.cluster.ray --cluster F --status F [--heal]`: keep a trial cluster up."""

from relaunch.cluster.ray.trial import serve

serve()
