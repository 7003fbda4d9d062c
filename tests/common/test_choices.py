"""Closed value sets: parsing names the flag and the allowed values; members behave as their values."""

from __future__ import annotations

import json

import pytest

from common.choices import Choice


class Colour(Choice):
    RED = "red"
    DARK_BLUE = "dark blue"


def test_parse_accepts_values_and_members_and_names_the_flag_otherwise() -> None:
    assert Colour.parse("red", "--colour", error=ValueError) is Colour.RED
    assert Colour.parse(Colour.DARK_BLUE, "--colour", error=ValueError) is Colour.DARK_BLUE
    with pytest.raises(KeyError, match="--colour 'green': expected one of red, dark blue"):
        Colour.parse("green", "--colour", error=KeyError)
    with pytest.raises(ValueError, match="--colour 'RED'"):
        Colour.parse("RED", "--colour", error=ValueError)  # values, not member names


def test_members_print_serialize_and_hash_as_their_values() -> None:
    assert str(Colour.RED) == "red" and f"{Colour.DARK_BLUE:>10}" == " dark blue"
    assert json.dumps({"c": Colour.RED}) == '{"c": "red"}'
    assert {"red": 1}[Colour.RED] == 1 and Colour.values() == ("red", "dark blue")
