"""The proxy's reward and event endpoints answer 400 with the reason to every reward that is not a finite number.

Bodies are posted as raw bytes, as a client that writes its own JSON would send them (``NaN`` and
``Infinity`` are not JSON, but Python's parser, and so the server's, reads them); what is refused
never reaches the spans topic, and a good reward after them lands alone.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from agentstream.infra.kafka import topic_name
from agentstream.infra.processes import free_port
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic

HOSTILE_REWARDS = [
    (b'{"reward": NaN}', "finite"),
    (b'{"reward": Infinity}', "finite"),
    (b'{"reward": -Infinity}', "finite"),
    (b'{"reward": 1e309}', "finite"),
    (b'{"reward": -1e309}', "finite"),
    (b'{"reward": 1' + b"0" * 400 + b"}", "beyond the range of a float"),
    (b'{"reward": "nan"}', "not a string"),
    (b'{"reward": "0.5"}', "not a string"),
    (b'{"reward": true}', "not bool"),
    (b'{"reward": [1]}', "not list"),
    (b'{"reward": null}', "needs a number"),
    (b'{"dimensions": {"accuracy": 1.0, "speed": NaN}}', "reward dimension 'speed' must be finite"),
    (b'{"dimensions": {"accuracy": Infinity}, "primary": "accuracy"}', "reward dimension 'accuracy' must be finite"),
    (b'{"dimensions": {"a": 1e308, "b": 1e308}}', "overflows"),
    (b'{"dimensions": {"a": "1"}}', "not a string"),
    (b'{"reward": 1.0, "dimensions": {"a": -Infinity}}', "finite"),
]


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, method="POST", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def proxy(publisher: SpanPublisher):
    # the reward and event endpoints never reach the upstream: nothing listens there
    running = ServerThread(LLMProxy(f"http://127.0.0.1:{free_port()}", publisher).app)
    yield running
    running.stop()


def test_every_hostile_reward_is_a_400_with_its_reason_and_lands_nowhere(proxy, publisher, topics_config,
                                                                         kafka_options):
    for body, says in HOSTILE_REWARDS:
        status, answer = post(f"{proxy.url}/rollouts/r-hostile/reward", body)
        assert status == 400, (body[:60], status, answer)
        assert says in answer["error"]["message"], (body[:60], answer)
        assert answer["error"]["type"] == "invalid_request_error"
        event = b'{"event_type": "reward", "data": ' + body.replace(b'"reward"', b'"value"') + b"}"  # 1.0's API
        status, answer = post(f"{proxy.url}/api/rollouts/r-hostile/attempt/r-hostile-1/events", event)
        assert status == 400 and says in answer["error"]["message"], (event[:60], status, answer)

    status, answer = post(f"{proxy.url}/rollouts/r-hostile/reward", b'{"reward": 0.25}')
    assert status == 202 and answer["reward"] == 0.25
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(topics_config.topics, "spans"),
                        lambda got: len(got.of("r-hostile")[0]) >= 1, timeout_s=20)
    spans = landed.of("r-hostile")[0]
    assert [(span["kind"], span["reward"]) for span in spans] == [("REWARD", 0.25)]
