"""`agentstream dashboard`: a live web UI over what ClickHouse (and Kafka) know about agents and training.

- :mod:`agentstream.dashboard.queries`: one function per chart, each returning its SQL;
- :mod:`agentstream.dashboard.readonly_client`: read-only ClickHouse queries over HTTP;
- :mod:`agentstream.dashboard.kafka_state`: consumer lag and dead letters from the broker;
- :mod:`agentstream.dashboard.server`: the aiohttp app, the JSON API and the static page.
"""
