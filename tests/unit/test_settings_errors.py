"""A bad setting is one line naming the field (the CLI prints it as ``rlmq: ...``)."""

from __future__ import annotations

import pytest

from rlmq.common.errors import ConfigError
from rlmq.common.settings import load_settings


def test_a_bad_value_is_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(concurrency=0)
    text = str(info.value)
    assert "\n" not in text and text.startswith("invalid setting(s): concurrency: "), text
    with pytest.raises(ConfigError) as info:
        load_settings().with_overrides(max_output_length=-1)
    text = str(info.value)
    assert "\n" not in text and "max_output_length: " in text, text
