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


@pytest.mark.parametrize(
    "value, seconds", [(300, 300.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("never", None), (-1, None), ("0", 0.0), ("-1m", None)]
)
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value, size", [(1024, 1024), ("12GiB", 12 * 1024**3), ("512 MB", 512 * 10**6), ("1.5k", 1500)])
def test_sizes(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "m5", "5", "-soon"])
def test_bad_durations_are_refused(tmp_path, bad):
    path = tmp_path / "c.toml"
    path.write_text(f'keep_alive = "{bad}"\n')
    with pytest.raises(ConfigError, match="not a duration"):
        load_config(path)


@pytest.mark.parametrize(
    "text, why",
    [
        ('api_key = "   "\n', "api_key is blank"),
        ('api_key = ""\n', "api_key is blank"),
        ('http_request_timeout = "never"\n', "http_request_timeout must be a duration"),
        ("control_request_timeout = -1\n", "control_request_timeout must be a duration"),
        ('metrics_request_timeout = "never"\n', "metrics_request_timeout must be a duration"),
    ],
)
def test_a_blank_key_or_an_unbounded_request_time_is_refused(tmp_path, text, why):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        load_config(path)


@pytest.mark.parametrize(
    "text, where",
    [
        ("max_adapters = 0\n", "`max_adapters`: Expected `int` >= 1"),
        ('[[models]]\nname = "a"\npath = "/m"\nmax_adapters = 2000\n', r"`models\[0\]\.max_adapters`: Expected `int` <= 1024"),
    ],
)
def test_max_adapters_is_checked(tmp_path, text, where):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_config(path)


def test_names_on_one_base_share_a_worker_key_unless_their_worker_settings_differ(tmp_path):
    from supervisor.resolve import Resolver

    (tmp_path / "m").mkdir()
    entries = [("a", None, ""), ("b", "/x", ""), ("c", "/y", "max_adapters = 2\n"), ("d", None, "max_batch = 2\n")]
    text = "max_adapters = 4\n" + "".join(
        f'[[models]]\nname = "{n}"\npath = "{tmp_path / "m"}"\n' + (f'lora = "{lora}"\n' if lora else "") + extra for n, lora, extra in entries
    )
    (tmp_path / "c.toml").write_text(text)
    resolver = Resolver(load_config(tmp_path / "c.toml"))
    specs = {n: resolver.resolve(n) for n, _, _ in entries}
    assert specs["a"].key == specs["b"].key == resolver.resolve("a", "/y").key and specs["a"].max_adapters == 4
    assert specs["a"].name_key != specs["b"].name_key != resolver.resolve("a", "/y").name_key
    assert len({specs[n].key for n in "acd"}) == 3 and specs["c"].max_adapters == 2


def test_aliases_resolve_to_their_entry_and_clash_with_no_name(tmp_path):
    from supervisor.resolve import Resolver

    (tmp_path / "m").mkdir()
    entry = f'[[models]]\nname = "a"\npath = "{tmp_path / "m"}"\naliases = ["x", "y"]\n[[models]]\nname = "b"\npath = "{tmp_path / "m"}"\n'
    (tmp_path / "c.toml").write_text(entry)
    resolver = Resolver(load_config(tmp_path / "c.toml"))
    assert resolver.resolve("x") is resolver.resolve("a") and resolver.resolve("y").name == "a"
    assert resolver.resolve("b").name == "b"
    for clash, repeated in (('aliases = ["b"]', "b"), ('aliases = ["x"]', "x"), ('aliases = ["z", "z"]', "z")):
        (tmp_path / "d.toml").write_text(entry + clash + "\n")
        with pytest.raises(ConfigError, match=f"names and aliases must be unique; repeated: {repeated}"):
            load_config(tmp_path / "d.toml")


@pytest.mark.parametrize("value, flag", [(None, "60.0"), ('"10s"', "10.0"), ('"never"', "inf"), ("0", "0.0")])
def test_idle_release_becomes_the_workers_flag(tmp_path, value, flag):
    from supervisor.child import worker_command
    from supervisor.resolve import Resolver

    (tmp_path / "m").mkdir()
    line = f"idle_release = {value}\n" if value is not None else ""
    (tmp_path / "c.toml").write_text(f'{line}[[models]]\nname = "a"\npath = "{tmp_path / "m"}"\n')
    config = load_config(tmp_path / "c.toml")
    argv, _ = worker_command(Resolver(config).resolve("a"), config, None)
    assert argv[argv.index("--idle-release") + 1] == flag


@pytest.mark.parametrize("line, eager", [("", False), ("compile_decode = true\n", False), ("compile_decode = false\n", True)])
def test_compile_decode_false_makes_the_workers_eager(tmp_path, line, eager):
    from supervisor.child import worker_command
    from supervisor.resolve import Resolver

    (tmp_path / "m").mkdir()
    (tmp_path / "c.toml").write_text(f'{line}[[models]]\nname = "a"\npath = "{tmp_path / "m"}"\n')
    config = load_config(tmp_path / "c.toml")
    argv, _ = worker_command(Resolver(config).resolve("a"), config, None)
    assert ("--eager-decode" in argv) == eager


@pytest.mark.parametrize("line, flag", [("", None), ("mask_threads = 3\n", "3")])
def test_mask_threads_becomes_the_workers_flag(tmp_path, line, flag):
    from supervisor.child import worker_command
    from supervisor.resolve import Resolver

    (tmp_path / "m").mkdir()
    (tmp_path / "c.toml").write_text(f'{line}[[models]]\nname = "a"\npath = "{tmp_path / "m"}"\n')
    config = load_config(tmp_path / "c.toml")
    argv, _ = worker_command(Resolver(config).resolve("a"), config, None)
    assert (argv[argv.index("--mask-threads") + 1] if "--mask-threads" in argv else None) == flag
    (tmp_path / "bad.toml").write_text("mask_threads = 0\n")
    with pytest.raises(ConfigError, match="mask_threads"):
        load_config(tmp_path / "bad.toml")


def test_a_bad_idle_release_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('idle_release = "soonish"\n')
    with pytest.raises(ConfigError, match="not a duration"):
        load_config(path)


@pytest.mark.parametrize(
    "extra, why",
    [
        ("quantized_kv_start = 4096\n", "quantized_kv_start is set without kv_bits"),
        ("kv_bits = 8\nquantized_kv_start = -1\n", r"quantized_kv_start`: Expected `int` >= 0"),
    ],
)
def test_quantized_kv_start_goes_with_kv_bits(tmp_path, extra, why):
    path = tmp_path / "c.toml"
    path.write_text(f'[[models]]\nname = "a"\npath = "/m"\n{extra}')
    with pytest.raises(ConfigError, match=why):
        load_config(path)
