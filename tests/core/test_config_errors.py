"""Config loading/validation and the one error-to-HTTP mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillover.config import Config, config_sample, default_model_path, describe_fields, load_config, parse_device
from spillover.errors import (
    ConfigError,
    ContextLengthExceeded,
    InvalidRequest,
    QueueFull,
    to_http,
)


def test_defaults_bind_loopback_and_validate() -> None:
    """The default config binds 127.0.0.1 and passes validation."""
    cfg = load_config()
    assert cfg.server.host == "127.0.0.1" and cfg.server.api_key == ""


def test_non_loopback_bind_requires_api_key() -> None:
    """Binding 0.0.0.0 without an API key is refused; with one it is accepted."""
    with pytest.raises(ConfigError, match="api_key"):
        load_config(overrides={"server": {"host": "0.0.0.0"}})
    assert load_config(overrides={"server": {"host": "0.0.0.0", "api_key": "k"}}).server.api_key == "k"


def test_toml_file_then_flags(tmp_path: Path) -> None:
    """TOML values apply, and flags override them."""
    f = tmp_path / "c.toml"
    f.write_text('[server]\nport = 9001\n[gpu_lane]\nslots = 3\n[device]\ngpu = "sim:512"\n')
    cfg = load_config(str(f), {"server": {"port": 9002}})
    assert (cfg.server.port, cfg.gpu_lane.slots, cfg.device.gpu) == (9002, 3, "sim:512")


@pytest.mark.parametrize(
    "toml",
    [
        "[nope]\nx = 1\n",
        "[server]\nbogus = 1\n",
        '[server]\nport = "80"\n',
        '[device]\ngpu = "tpu:0"\n',
        "[gpu_lane]\nslots = 0\n",
        "[admission]\npressure_ratio = 0.9\nbogus = 1\n",
        '[model]\nfallback_path = "/nonexistent/fallback.gguf"\n',
        '[model]\nfallback_name = "small"\n',
        '[cpu_lane]\nreadiness = "hot"\n',
        "[split]\nslots = 0\n",
        "[split]\ngpu_layers = -2\n",
        "[split]\nctx_cap_tokens = 10\n",
        "[split]\nenabled = true\ngpu_layers = 0\n",  # no layer on the device: the CPU lane
        '[split]\nenabled = true\n[device]\ngpu = "none"\n',  # a split with no device
        "[cpu_lane]\nrecovery_budget_ms = 0\n",
        "[cpu_lane]\nrecovery_budget_ms = inf\n",
        "[cpu_lane]\nrecovery_budget_ms = nan\n",
        '[[services]]\nname = "c2"\nkind = "chat"\ncpu_readiness = "mapped"\n',
        '[[services]]\nname = "c2"\nkind = "chat"\nrecovery_budget_ms = -5\n',
        '[[services]]\nname = "e2"\nkind = "embeddings"\ncpu_readiness = "hot"\n',
        '[[services]]\nname = "t2"\nkind = "transcription"\ncpu_readiness = "auto"\nrecovery_budget_ms = -1\n',
        '[[services]]\nname = "e2"\nkind = "embeddings"\nrecovery_budget_ms = 300\n',
        '[[services]]\nname = "e2"\nkind = "embeddings"\ncpu = "none"\ncpu_readiness = "on_demand"\n',
        '[[services]]\nname = "c2"\nkind = "chat"\ncpu = "none"\nrecovery_budget_ms = 300\n',
        "[server]\nstream_coalesce_ms = -1\n",
        "[server]\nstream_coalesce_ms = nan\n",
        "[server]\nstream_coalesce_ms = 1000.5\n",
        '[[services]]\nname = "c2"\nkind = "chat"\ncpu_readiness = "warm"\nrecovery_budget_ms = 300\n',  # no effect
        '[cpu_lane]\nreadiness = "mmap"\n[[services]]\nname = "c2"\nkind = "chat"\nrecovery_budget_ms = 300\n',
        '[[services]]\nname = "e2"\nkind = "embeddings"\ncpu_readiness = "on_demand"\nrecovery_budget_ms = 9\n',
        '[gpu_lane]\nreadiness = "warm"\n',  # the CPU replica's settings: nothing on the GPU lane
        "[gpu_lane]\nrecovery_budget_ms = 500\n",
        "[gpu_lane]\ncanary_ratio = 0.5\n",
    ],
)
def test_bad_config_is_rejected(tmp_path: Path, toml: str) -> None:
    """Unknown sections/keys, wrong types and out-of-range values raise ConfigError."""
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError):
        load_config(str(f))


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[server]\nport = "80"\n', "[server].port must be an integer, not a string"),
        ('[model]\naliases = "x"\n', "[model].aliases must be a list of strings, not a string"),
        ("[device]\nmargin_mib = 1979-05-27\n", "[device].margin_mib must be an integer, not a date or time"),
        ("[breaker]\ncooldown_s = true\n", "[breaker].cooldown_s must be a number, not true or false"),
        ("[server]\nhost = [1]\n", "[server].host must be a string, not an array"),
        # a [[services]] entry is counted from 1 in every message, as its later checks count it
        ('[[services]]\nname = "a"\nbatch = 3\n', "unknown setting batch in [[services]] #1"),
        (
            '[[services]]\nname = "a"\n[[services]]\nname = "b"\ngpu_slots = "2"\n',
            "gpu_slots in [[services]] #2 must be an integer, not a string",
        ),
        ('[[services]]\nname = "a"\n[[services]]\nname = "a"\n', "[[services]] #2 (a)"),
    ],
)
def test_a_bad_setting_is_named_in_toml_words(tmp_path: Path, toml: str, message: str) -> None:
    """Types in TOML's words (it said "must be tuple, got str"), services counted from 1."""
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(str(f))
    assert message in str(caught.value)


def test_a_retired_setting_starts_with_a_warning_that_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``[admission].pressure_ratio`` was printed by ``spillover config`` but read by nothing (a
    config field nothing reads). It is gone; a config written with it still loads, and the log
    says it is ignored and why."""
    f = tmp_path / "c.toml"
    f.write_text("[admission]\npressure_ratio = 0.95\ndelay_max_s = 1.5\n")
    with caplog.at_level("WARNING", logger="spillover.config"):
        cfg = load_config(str(f))
    assert cfg.admission.delay_max_s == 1.5 and not hasattr(cfg.admission, "pressure_ratio")
    assert "[admission].pressure_ratio is ignored" in caplog.text and "never changed a decision" in caplog.text
    assert "pressure_ratio" not in config_sample()


def test_a_recovery_budget_is_milliseconds_up_to_a_day(tmp_path: Path) -> None:
    """A day is the most (any longer picks as a day does); a service's message names its 0."""
    assert load_config(overrides={"cpu_lane": {"recovery_budget_ms": 86_400_000.0}}).cpu_lane.recovery_budget_ms
    with pytest.raises(
        ConfigError, match=r"\[cpu_lane\].recovery_budget_ms must be .* at most 86400000 \(a day\), not 1e\+308"
    ):
        load_config(overrides={"cpu_lane": {"recovery_budget_ms": 1e308}})
    f = tmp_path / "c.toml"
    f.write_text('[[services]]\nname = "c2"\nkind = "chat"\nrecovery_budget_ms = -5\n')
    with pytest.raises(ConfigError, match=r"> 0 \(0: \[cpu_lane\]'s\)"):
        load_config(str(f))


@pytest.mark.parametrize("ms", [0, 20, 1000])
def test_stream_coalesce_ms_takes_zero_to_a_second(ms: int) -> None:
    assert load_config(overrides={"server": {"stream_coalesce_ms": float(ms)}}).server.stream_coalesce_ms == ms


def test_fallback_model_name(tmp_path: Path) -> None:
    """A fallback model is named after its file unless named; it may not take the main model's name."""
    f = tmp_path / "small-model.gguf"
    f.write_bytes(b"GGUF")
    assert load_config().fallback_model_name() is None
    assert load_config(overrides={"model": {"fallback_path": str(f)}}).fallback_model_name() == "small-model"
    named = load_config(overrides={"model": {"fallback_path": str(f), "fallback_name": "fb"}})
    assert named.fallback_model_name() == "fb"
    with pytest.raises(ConfigError, match="differ"):
        load_config(overrides={"model": {"fallback_path": str(f), "fallback_name": named.model.name}})


def test_every_field_documented_and_in_sample() -> None:
    """Every setting has a doc line; the sample shipped in the repo is what ``spillover config``
    prints (regenerate it with ``spillover config > spillover.example.toml``), and loaded back it
    is the default configuration, every default service included (the sample once held only
    the first, so a file made from it served no transcription)."""
    path = Path(__file__).parents[2] / "spillover.example.toml"
    for section, name, _default, doc in describe_fields():
        assert doc, f"{section}.{name} has no doc"
    assert path.read_text() == config_sample(), "spillover.example.toml is not `spillover config`'s output"
    loaded = load_config(str(path))
    assert loaded == Config() and [s.name for s in loaded.services] == ["bge-small-en", "whisper-tiny.en"]


def test_the_sample_with_another_model_serves_it_under_its_own_name(tmp_path: Path) -> None:
    """--model other.gguf with the sample as its config: served as ``other``, no alias (the
    sample's name and aliases, which follow the path, are commented out; written out, they
    served any file as smollm2-135m-instruct)."""
    other = tmp_path / "other.gguf"
    other.symlink_to(default_model_path())
    sample = Path(__file__).parents[2] / "spillover.example.toml"
    cfg = load_config(str(sample), overrides={"model": {"path": str(other)}})
    assert (cfg.model.name, cfg.model.aliases) == ("other", ())


def test_parse_device() -> None:
    """Device specs parse; nonsense is a ConfigError."""
    assert parse_device("sim:2048") == ("sim", 2048)
    assert parse_device("cuda:1") == ("cuda", 1)
    with pytest.raises(ConfigError):
        parse_device("sim:0")


def test_to_http_shapes() -> None:
    """Errors map to OpenAI-shaped bodies; capacity errors carry Retry-After, and the same wait
    as their estimated delay (round 65: a refusal's answer said 0 beside Retry-After: 16)."""
    e = to_http(InvalidRequest("bad", param="temperature"))
    assert e.status == 400 and e.body["error"]["param"] == "temperature"
    assert to_http(ContextLengthExceeded("long")).body["error"]["code"] == "context_length_exceeded"
    q = to_http(QueueFull("full", retry_after_s=2.5))
    assert q.status == 503 and q.headers["Retry-After"] == "3" and q.headers["retry-after-ms"] == "2500"
    assert q.headers["X-Spillover-Estimated-Delay-Ms"] == "2500"  # the wait it was refused for, not 0
    assert to_http(RuntimeError("x")).status == 500


def test_a_chat_service_inherits_the_cpu_lanes_readiness_unless_it_sets_its_own(tmp_path: Path) -> None:
    from spillover.runtime.chat import chat_models

    f = tmp_path / "c.toml"
    f.write_text(
        '[cpu_lane]\nreadiness = "warm"\nrecovery_budget_ms = 250\n'
        '[[services]]\nname = "a"\nkind = "chat"\n'
        '[[services]]\nname = "b"\nkind = "chat"\ncpu_readiness = "auto"\nrecovery_budget_ms = 5000\n'
    )
    _, a, b = chat_models(load_config(str(f)))
    assert (a.cpu_lane.readiness, a.cpu_lane.recovery_budget_ms) == ("warm", 250)
    assert (b.cpu_lane.readiness, b.cpu_lane.recovery_budget_ms) == ("auto", 5000)


def test_an_embeddings_or_transcription_replica_is_warm_unless_its_service_says_otherwise(tmp_path: Path) -> None:
    """[cpu_lane].readiness is the chat services' default only; the budget is every kind's."""
    f = tmp_path / "c.toml"
    f.write_text(
        '[cpu_lane]\nreadiness = "on_demand"\nrecovery_budget_ms = 250\n'
        '[[services]]\nname = "e"\nkind = "embeddings"\n'
        '[[services]]\nname = "t"\nkind = "transcription"\ncpu_readiness = "auto"\nrecovery_budget_ms = 900\n'
        '[[services]]\nname = "c"\nkind = "chat"\n'
    )
    cfg = load_config(str(f))
    assert [cfg.service_readiness(s) for s in cfg.services] == [("warm", 250), ("auto", 900), ("on_demand", 250)]


@pytest.mark.parametrize("key", ["readiness", "recovery_budget_ms", "canary_ratio"])
def test_a_cpu_lane_setting_in_gpu_lane_says_where_it_belongs(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[gpu_lane\]\.{key} is a CPU lane setting .*set it in \[cpu_lane\]"):
        load_config(overrides={"gpu_lane": {key: {"readiness": "warm"}.get(key, 1.0)}})
