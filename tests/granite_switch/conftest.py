"""Session fixtures for the Granite Switch tests.

`switch_assets` builds, once per session in a temporary folder, the tiny Granite base,
its PEFT adapters, the composed Switch checkpoint and manifest.json, by running
tests/granite_switch/oracle/build_assets.py in the granite-switch oracle venv
(created by `bash tests/granite_switch/oracle/install.sh`). Nothing is downloaded.
"""

from __future__ import annotations

import pytest

from tests.granite_switch.oracle_env import Assets, build_assets


@pytest.fixture(scope="session")
def switch_assets(tmp_path_factory) -> Assets:
    return build_assets(str(tmp_path_factory.mktemp("granite_switch")))
