"""What serves what: the deployments log, routing, the gate and rebase.

``deploy`` sits beside ``trainer`` (they talk through the checkpoints and deployments topics,
never by import) and below ``pipeline`` (the proxy routes with :mod:`deploy.routing`) and
``serving`` (hot swap loads what the deployments name).
"""
