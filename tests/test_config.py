from pathlib import Path

import pytest

from supervisor.config import Config, ConfigError, load_config, parse_duration, parse_size

ROOT = Path(__file__).resolve().parent.parent


def test_example_config_documents_every_key():
    text = (ROOT / "configs" / "example.toml").read_text()
    for key in Config.__struct_fields__:
        if key not in ("models", "defaults"):
            assert f"{key} =" in text, key
    config = load_config(ROOT / "configs" / "example.toml")
    assert config.stall_timeout == 120


@pytest.mark.parametrize("value, seconds", [(300, 300.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("never", None), (-1, None)])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value, size", [(1024, 1024), ("12GiB", 12 * 1024**3), ("512 MB", 512 * 10**6), ("1.5k", 1500)])
def test_sizes(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "m5"])
def test_bad_durations_are_refused(tmp_path, bad):
    path = tmp_path / "c.toml"
    path.write_text(f'keep_alive = "{bad}"\n')
    with pytest.raises(ConfigError, match="not a duration"):
        load_config(path)
