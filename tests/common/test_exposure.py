"""The public development secret is refused wherever the data plane is reachable from other hosts."""

from __future__ import annotations

import pytest

from dejavu_common.exposure import InsecureDefaultError, check_data_plane
from dejavu_common.settings import DEV_DATA_PLANE_SECRET, Settings, TransportSettings


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "192.168.1.2", "worker-0.dejavu", "::"])
def test_the_development_secret_is_refused_beyond_loopback(host: str) -> None:
    with pytest.raises(InsecureDefaultError, match="DEJAVU_TRANSPORT__SECRET"):
        check_data_plane(TransportSettings(host=host))
    check_data_plane(TransportSettings(host=host, secret="a-real-per-deployment-secret"))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_development_secret_serves_a_single_host(host: str) -> None:
    assert Settings().transport.secret.get_secret_value() == DEV_DATA_PLANE_SECRET
    check_data_plane(TransportSettings(host=host))


def test_a_worker_refuses_before_opening_its_data_plane() -> None:
    from dejavu_worker.endpoint import DataEndpoint

    with pytest.raises(InsecureDefaultError):
        DataEndpoint(TransportSettings(host="10.0.0.7"), "t0")
