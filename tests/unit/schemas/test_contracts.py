"""Contracts: the train flag's header and attribute names, and how its values parse."""

from __future__ import annotations

import pytest

from agentstream.schemas.contracts import TRAIN_ATTRIBUTE, TRAIN_HEADER, TrainFlagError, parse_train_flag


def test_contract_names():
    assert TRAIN_HEADER == "X-Agentstream-Train" and TRAIN_ATTRIBUTE == "agentstream.train"


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None),
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True), (" true ", True),
    ("false", False), ("False", False), ("0", False), ("NO", False), ("off", False),
])
def test_parse_train_flag(value, expected):
    assert parse_train_flag(value) is expected


@pytest.mark.parametrize("value", ["maybe", "2", "tru", "true false", "-1", "y"])
def test_parse_train_flag_refuses_anything_else_with_a_named_error(value):
    with pytest.raises(TrainFlagError, match=r"training flag .* got") as caught:
        parse_train_flag(value)
    assert isinstance(caught.value, ValueError) and repr(value) in str(caught.value)
