"""Parallel options: validated where they are given, flags derived from the fields, and the
topology of a rank from the options or a launcher's environment."""

from __future__ import annotations

import argparse

import pytest

from deepinfer.config import ConfigError, EngineConfig, ParallelConfig
from deepinfer.config.flags import add_config_flags, build_config, given_options
from deepinfer.distributed.topology import resolve_topology


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "data_parallel_size"),
        ({"tensor_parallel_size": 3, "nnodes": 2}, "nnodes"),
        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "node_rank"),
        ({"master_port": 70000}, "master_port"),
        ({"enable_eplb": True}, "enable_eplb"),
        ({"num_redundant_experts": 2}, "num_redundant_experts"),
        ({"eplb_policy": "random"}, "eplb_policy"),
    ],
)
def test_bad_parallel_options_name_the_option(options, names):
    with pytest.raises(ConfigError) as error:
        ParallelConfig(**options)
    assert error.value.name == names


def test_features_not_run_over_several_ranks_are_refused_before_loading():
    with pytest.raises(ConfigError, match="speculative_method"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_method="ngram")
    with pytest.raises(ConfigError, match="kv_store"):
        EngineConfig.from_kwargs(data_parallel_size=2, kv_host_cache_bytes="1GiB")


def test_flags_come_from_the_fields():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, "engine", skip=("model",))
    args = parser.parse_args(
        ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29555"]
    )
    config = build_config(parser, EngineConfig, given_options(args, EngineConfig))
    assert (config.parallel.tensor_parallel_size, config.parallel.nnodes, config.parallel.node_rank) == (
        2,
        2,
        1,
    )
    args = parser.parse_args(["--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    with pytest.raises(SystemExit):
        build_config(parser, EngineConfig, given_options(args, EngineConfig))


def test_topology_of_a_machine_started_by_us():
    two_nodes = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    topology = resolve_topology(two_nodes, environ={})
    assert (topology.rank, topology.node_ranks, topology.master_port) == (2, range(2, 4), 29500)
    assert not topology.local_channel
    one = resolve_topology(ParallelConfig(data_parallel_size=2), environ={})
    assert one.rank == 0 and one.local_channel and one.master_port > 0
    assert [one.for_rank(r).dp_rank for r in range(2)] == [0, 1]


def test_topology_from_a_launchers_environment():
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    environ |= {"MASTER_ADDR": "node0", "MASTER_PORT": "29511"}
    topology = resolve_topology(ParallelConfig(tensor_parallel_size=4), environ=environ)
    assert (topology.rank, topology.nnodes, topology.node_rank, topology.tp_rank) == (3, 2, 1, 3)
    assert (topology.master_addr, topology.master_port, topology.external_launch) == ("node0", 29511, True)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        resolve_topology(ParallelConfig(tensor_parallel_size=2), environ=environ)


def test_cpu_share_splits_the_cores():
    topology = resolve_topology(ParallelConfig(tensor_parallel_size=2), environ={})
    assert topology.cpu_share([0, 1, 2, 3], None) == [0, 1]
    assert topology.for_rank(1).cpu_share([0, 1, 2, 3], None) == [2, 3]
    assert topology.for_rank(1).cpu_share([0, 1], 1) == [1]
