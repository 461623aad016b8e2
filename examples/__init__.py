"""Example agents trained by agentstream, each written the way its framework's users write agents."""
