"""The runner side's work queue (``agentstream run``, ``agentstream enqueue``): tasks in, agents run.

``tasks`` puts Task records on the tasks topic, ``pool`` consumes them as a consumer group and runs the
agent, ``agl`` runs Agent Lightning agents unchanged, ``errors`` holds what ``import agentstream`` exports
without importing the pool, and ``main`` is the process.
"""
