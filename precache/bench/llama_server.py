"""One llama-server process on loopback (:class:`LlamaServer`), as the llama.cpp baseline
(:mod:`precache.bench.llama_cpp`) runs it: every agent's LoRA loaded at scale 0 and applied per
request, greedy ``/completion`` of token ids, slots erased between replays.

On a CPU with AMX the server runs with ``--no-repack``: llama.cpp's AMX-repacked quantized weights
crash llama-server as it loads the LoRA adapters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from precache.bench.llama_cpp_gguf import LlamaCppTree
from precache.errors import PrecacheError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


def _has_amx() -> bool:
    """Whether this CPU has AMX (``amx_int8`` among /proc/cpuinfo's flags; False elsewhere)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on loopback: ``model`` with ``loras`` loaded at scale 0, ``slots``
    slots of ``slot_context`` tokens each, ``threads`` threads, ``cache_ram_mib`` MiB of RAM prompt
    cache (0: none, the baseline's setting; llama-server's own default is 8192). A context
    manager; ``close`` stops it.

    Raises:
        PrecacheError: the server exited or did not answer ``/health`` within 120 s (the log's
        last lines in the message).
    """

    def __init__(
        self,
        tree: LlamaCppTree,
        model: Path,
        loras: list[Path],
        slots: int,
        slot_context: int,
        threads: int,
        cache_ram_mib: int = 0,
    ):
        self.port = _free_port()
        self.slots = slots
        self.workdir = tempfile.TemporaryDirectory(prefix="llama-server-")
        self.log = open(Path(self.workdir.name) / "server.log", "wb")  # noqa: SIM115
        cmd = [
            str(tree.server),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(slots),
            "-c",
            str(slots * slot_context),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-webui",
            "--cache-ram",
            str(cache_ram_mib),
            "--slot-save-path",
            self.workdir.name,
        ]
        if loras:
            cmd += ["--lora", ",".join(str(p) for p in loras), "--lora-init-without-apply"]
            if _has_amx():
                # llama.cpp's AMX-repacked weights with LoRA adapters crash llama-server as it
                # starts (SIGSEGV, q8_0, llama-cpp-python 0.3.36's tree; 2026-12-02): its other
                # CPU kernels then
                cmd.append("--no-repack")
        logger.debug("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrecacheError(f"llama-server exited ({self.proc.returncode}):\n{self._log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise PrecacheError(
            f"llama-server did not answer /health in {START_TIMEOUT_S:.0f} s:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-8:])

    def post(self, path: str, body: dict | None = None) -> dict:
        """POST ``body`` as JSON to ``path``; the JSON answer.

        Raises:
            PrecacheError: an HTTP error (the server's message in ours).
        """
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise PrecacheError(f"llama-server {path}: {exc.code} {exc.read()[:300]!r}") from exc

    def complete(self, prompt: list[int], n_predict: int, slot: int, adapter: int, adapters: int) -> dict:
        """One greedy ``/completion`` of token ids ``prompt``: exactly ``n_predict`` tokens
        (``ignore_eos``), in ``slot`` (-1: llama.cpp chooses), with LoRA ``adapter`` at scale 1
        and the other ``adapters - 1`` at 0; llama-server's answer (``tokens``, ``timings``, ...)."""
        return self.post(
            "/completion",
            {
                "prompt": prompt,
                "n_predict": n_predict,
                "temperature": 0.0,
                "samplers": ["temperature"],
                "ignore_eos": True,
                "cache_prompt": True,
                "id_slot": slot,
                "return_tokens": True,
                "lora": [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(adapters)],
            },
        )

    def erase_slots(self) -> None:
        """Drop every slot's cache (a replay starts with nothing cached)."""
        for slot in range(self.slots):
            self.post(f"/slots/{slot}?action=erase")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.workdir.cleanup()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
