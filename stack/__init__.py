"""The embedded servers of the one-command stack: broker runner, ClickHouse front, object store, Schema Registry server.

``agentstream up`` starts them (:mod:`agentstream.stack.control`); an external Kafka or ClickHouse, where configured,
replaces
its embedded one. Machine calibration (:mod:`agentstream.stack.machine`) lives here too. Of the product packages only
agentstream imports this one; the processes of a run reach these servers over the network.
"""
