"""Live-appliance fixture: one `appliance serve` subprocess (tiny dense checkpoint) per test module;
its clean SIGTERM exit (code 0) is asserted at teardown."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.live import start_appliance


@pytest.fixture(scope="module")
def appliance(tiny_dense, tmp_path_factory):
    """One appliance for a whole test module; its clean SIGTERM exit is asserted at the end."""
    app = start_appliance(
        tiny_dense, tmp_path_factory.mktemp("live") / "appliance.log", "--max-num-seqs", "16"
    )
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def sdk(appliance):
    """The official SDK against the module's appliance (no retries: each status is seen once)."""
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(sdk):
    return sdk.models.list().data[0].id


@pytest.fixture(scope="module")
def http(appliance):
    """An httpx client on the module's appliance's /v1 routes (a module may define its own)."""
    with httpx.Client(base_url=f"{appliance.url}/v1", timeout=120) as client:
        yield client
