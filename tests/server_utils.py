"""A real ``vlmserve serve`` process on a free localhost port, for the API tests."""

from __future__ import annotations

import base64
import io
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports for an mlx.launch ring (rank r binds the first + r).
    Below Linux's ephemeral range (32768 on), as mlx.launch's own default 32323 is: there no client
    connection takes one of them between this check and the bind. Not 32323 itself: two groups at
    once would share it."""
    for _ in range(200):
        first = random.randrange(20000, 32700 - count)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError("no free ports for the ring")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_server(args: list[str], log_path: Path, wait_ready: bool = True, timeout: float = 120,
                 env: dict[str, str] | None = None) -> ServerProcess:
    port = free_port()
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "vlmserve.cli", "--log-level", "info", "serve", "--port", str(port), *args]
    # The BLAS (and with it --dtype auto) must not depend on what the machine has installed.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLMSERVE_NO_OPENBLAS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log_path)
    if wait_ready:
        wait_for(server, "/ready", timeout)
    return server


def wait_for(server: ServerProcess, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log}")
        try:
            if httpx.get(server.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise TimeoutError(f"server not ready in {timeout}s:\n{server.log}")


def image_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class PipelineProcess(ServerProcess):
    """``mlx.launch --backend ring -n N -- vlmserve serve ...`` on loopback: rank 0 serves HTTP."""

    ranks: int = 2

    def rank_pid(self, rank: int) -> int:
        import re

        found = re.search(rf"pipeline rank {rank} of {self.ranks} \(pid (\d+)\)", self.log)
        assert found, f"rank {rank} never started:\n{self.log}"
        return int(found.group(1))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """SIGTERM to rank 0 (it drains, then stops every rank); whatever is left is killed."""
        if self.proc.poll() is None:
            try:
                os.kill(self.rank_pid(0), sig)
                return self.proc.wait(timeout)
            except (AssertionError, ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill_ranks()
        return self.proc.wait(timeout)

    def kill_ranks(self) -> None:
        for rank in range(self.ranks):
            try:
                os.kill(self.rank_pid(rank), signal.SIGKILL)
            except (AssertionError, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()


def start_pipeline(args: list[str], log_path: Path, ranks: int = 2, wait_ready: bool = True, timeout: float = 120,
                   models_by_rank: tuple[str, ...] | None = None) -> PipelineProcess:
    """``args`` after ``serve``; ``models_by_rank``: a ``--model`` of its own for each rank (through a
    shell line that reads ``MLX_RANK``), to make the ranks disagree."""
    import shlex

    port = free_port()
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    command = ["-m", "vlmserve.cli", "--log-level", "info", "serve", "--port", str(port), *args]
    interpreter = sys.executable
    if models_by_rank is not None:
        pick = " ".join(f"[ $MLX_RANK = {r} ] && M={shlex.quote(m)};" for r, m in enumerate(models_by_rank))
        command = ["-c", f'{pick} exec {shlex.quote(sys.executable)} {shlex.join(command)} --model "$M"']
        interpreter = "/bin/bash"
    ring = ["--starting-port", str(ring_ports(ranks))]
    cmd = [launcher, "--backend", "ring", "-n", str(ranks), *ring, "--python", interpreter, "--", *command]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLMSERVE_NO_OPENBLAS": "1"}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    server = PipelineProcess(proc, port, log_path, ranks)
    if wait_ready:
        wait_for(server, "/ready", timeout)
    return server
