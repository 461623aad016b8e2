"""What serves what: the checkpoints topic followed, the deployments log, routing, the gate and rebase.

The trainer writes checkpoints; what serves them is decided here. ``deploy`` sits beside
``trainer`` (they talk through the checkpoints and deployments topics, never by import) and
below ``pipeline`` (the proxy routes with :mod:`agentstream.deploy.routing`) and ``serving`` (hot swap
follows the checkpoints with :mod:`agentstream.deploy.checkpoint_follower`). The record itself,
:class:`agentstream.schemas.checkpoint.Checkpoint`, is a wire contract, so the trainer writes what deploy reads.
"""
