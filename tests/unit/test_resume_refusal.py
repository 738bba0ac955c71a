"""``--resume`` refuses another model or rollout option in one line that names each flag once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmq.cli.flags import flag_label
from rlmq.cli.run_folder import RESUME_SAME, LiveRunFolder
from rlmq.common.errors import ConfigError


def test_the_refusal_names_each_flag_once(tmp_path: Path) -> None:
    assert len(RESUME_SAME) == len(set(RESUME_SAME))
    recorded = {"model": "m", "sub_model": "s1", "max_turns": 50, "max_depth": 1}
    (tmp_path / "meta.json").write_text(json.dumps({"settings": recorded}))
    now = {**recorded, "sub_model": "s2", "max_depth": 2}
    with pytest.raises(ConfigError) as info:
        LiveRunFolder(tmp_path).check_resume(now, label=flag_label)
    text = str(info.value)
    assert text.count("--sub-model") == 1 and '--sub-model "s1" (now "s2")' in text, text
    assert text.count("--max-depth") == 1 and "--max-turns" not in text, text
