"""``python -m agentstream.stack.objectstore``: the store as a process (what ``agentstream up`` starts)."""

from agentstream.stack.objectstore.server import main

main()
