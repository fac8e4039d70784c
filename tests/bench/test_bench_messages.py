"""`dsv4-cluster bench`'s words to the operator, without a cluster: a URL it cannot use is refused when the
arguments are parsed."""

from __future__ import annotations

import pytest

from dsv4_cluster.orchestrator.cli.commands import main


@pytest.mark.parametrize("url, example", [("localhost:30001", "http://localhost:30001"),
                                          ("127.0.0.1:30001", "http://127.0.0.1:30001"),
                                          ("ftp://127.0.0.1:30001", "http://127.0.0.1:30001")])
def test_bench_refuses_a_url_that_is_not_http_when_parsing(url: str, example: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`bench localhost:30001` failed with httpx's UnsupportedProtocol, as if the cluster did not answer."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", url, "--requests", "1"])
    assert exited.value.code == 2
    assert f"argument url: {url!r}: give a full URL such as {example}" in capsys.readouterr().err
