from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deepinfer.config import ConfigError, EngineConfig, StoreConfig
from deepinfer.config.flags import add_config_flags, build_config, given_options
from deepinfer.store import (
    FileBackend,
    RedisBackend,
    build_kv_store,
    parse_duration,
    parse_retention,
    parse_store_url,
)


def test_retention_spec_overrides_and_adds_classes() -> None:
    policy = parse_retention("agent=3d,chat=7d,batch=12h")
    assert policy.ttl("agent") == 3 * 86400
    assert policy.ttl("chat") == 7 * 86400
    assert policy.ttl("batch") == 12 * 3600
    assert parse_retention("chat=1d").ttl("agent") == 3 * 86400  # defaults stay


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("1.5h", 5400), ("1w", 604800)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("chat", "CLASS=DURATION"),
        ("chat=7x", "'chat'"),
        ("chat=0d", "positive"),
        ("bad name=1d", "traffic class name"),
    ],
)
def test_bad_retention_names_the_problem(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_retention(spec)


def test_unknown_traffic_class_names_the_field() -> None:
    with pytest.raises(ValueError, match="traffic_class 'batch' is not configured"):
        parse_retention("agent=3d").ttl("batch")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("2GB", 2 * 10**9),
        ("4g", 4 << 30),
        (7, 7),
    ],
)
def test_host_tier_sizes_parse_like_every_other_size(text: str | int, value: int) -> None:
    assert StoreConfig(kv_host_cache_bytes=text).kv_host_cache_bytes == value


def test_bad_byte_size_names_the_option() -> None:
    with pytest.raises(ConfigError, match="kv_host_cache_bytes"):
        StoreConfig(kv_host_cache_bytes="lots")


@pytest.mark.parametrize(
    ("url", "kind", "path", "host", "port", "db"),
    [
        ("/mnt/3fs/kv", "file", "/mnt/3fs/kv", "", 6379, 0),
        ("relative/dir", "file", "relative/dir", "", 6379, 0),
        ("file:///mnt/nfs/kv", "file", "/mnt/nfs/kv", "", 6379, 0),
        ("redis://cache-1:6380/2", "redis", "", "cache-1", 6380, 2),
        ("redis://10.0.0.5", "redis", "", "10.0.0.5", 6379, 0),
    ],
)
def test_store_urls(url: str, kind: str, path: str, host: str, port: int, db: int) -> None:
    location = parse_store_url(url)
    assert (location.kind, location.path, location.host, location.port, location.db) == (
        kind,
        path,
        host,
        port,
        db,
    )


def test_redis_credentials() -> None:
    location = parse_store_url("redis://svc:p%40ss@h:1/0")
    assert (location.username, location.password) == ("svc", "p@ss")


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("s3://bucket/kv", "unsupported scheme 's3'"),
        ("redis://:6379", "names no host"),
        ("redis://h:notaport", "invalid port"),
        ("redis://h:6379/zero", "must be a number"),
        ("file://", "names no directory"),
        ("", "empty"),
    ],
)
def test_bad_store_urls_name_the_option(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="--kv-store") as info:
        parse_store_url(url)
    assert fragment in str(info.value)


def test_cli_flags_build_the_tier_stack(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, "engine", skip=("model",))
    args = parser.parse_args(
        [
            "--kv-store",
            f"file://{tmp_path}",
            "--kv-host-cache-bytes",
            "1MiB",
            "--kv-retention",
            "agent=1d,batch=2h",
            "--kv-chunk-blocks",
            "4",
        ]
    )
    config = build_config(parser, EngineConfig, given_options(args, EngineConfig))
    assert config.store.traffic_classes == ["agent", "batch", "chat"]
    store = build_kv_store(config.store.settings())
    assert store is not None
    try:
        assert isinstance(store.backend, FileBackend)
        assert store.backend.root == tmp_path / "v1"
        assert store.host is not None and store.host.capacity_bytes == 1 << 20
        assert store.retention.ttl("batch") == 7200
        assert store.blocks_per_chunk == 4
    finally:
        store.close()


def test_redis_url_builds_a_redis_backend_without_connecting() -> None:
    store = build_kv_store(StoreConfig(kv_store="redis://127.0.0.1:1/3").settings())
    assert store is not None
    try:
        assert isinstance(store.backend, RedisBackend)
        assert store.backend.key_prefix == "deepinfer:kv:v1:"
        assert store.host is None
    finally:
        store.close()


def test_nothing_configured_means_no_store() -> None:
    assert build_kv_store(StoreConfig().settings()) is None


def test_encryption_at_rest_needs_the_cluster_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_store_encrypt.*--cluster-key-file"):
        EngineConfig.from_kwargs(kv_store=str(tmp_path), kv_store_encrypt=True)
    key = tmp_path / "cluster.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    config = EngineConfig.from_kwargs(
        kv_store=str(tmp_path), kv_store_encrypt=True, cluster_key_file=str(key)
    )
    assert config.store.settings().encrypt
