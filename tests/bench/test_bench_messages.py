"""`dsv4-cluster bench`'s words to the operator, without a cluster: a URL it cannot use is refused when the
arguments are parsed, and a refusal the endpoint explains is shown with the endpoint's own explanation."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from dsv4_cluster.orchestrator.cli.commands import main
from dsv4_cluster.workers.http.responses import error_response
from tests.servers import UvicornThread

PREFILL_REFUSAL = ("bootstrap_room is required: a prefill server only serves requests paired by the router "
                   "(send requests to the router, not to the prefill worker)")   # workers/prefill/server.py


def _worker_like() -> FastAPI:
    """What a PD worker answers a client that found its URL: the model list, and a 400 for every chat."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "dsv4-tiny", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat():
        return error_response(400, PREFILL_REFUSAL)

    return app


def test_bench_at_a_worker_shows_the_workers_own_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """The table said only "HTTP 400 invalid_request_error x2"; the worker's "send requests to the router" was lost."""
    with UvicornThread(_worker_like()) as worker:
        code = main(["bench", worker.url, "--concurrency", "1", "--requests", "2", "--max-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "HTTP 400 invalid_request_error x2" in out
    assert "bench: concurrency 1: 2 of 2 requests failed, e.g. request " in err, err
    assert f": HTTP 400 invalid_request_error: {PREFILL_REFUSAL}\n" in err, err


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
