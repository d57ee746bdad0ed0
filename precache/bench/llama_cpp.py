"""llama.cpp as a baseline of ``bench trace``: llama-server with every agent's LoRA loaded and the
turn's adapter applied per request (its ``lora`` field), the model and adapters converted to GGUF
with llama.cpp's own converters.

Five configurations (:data:`CONFIGS`), each a runner of :func:`precache.bench.suite.run_suite`:

- ``llama-cpp-f32`` / ``llama-cpp-q8_0``: one slot per agent (``id_slot``), llama.cpp's best for
  a multi-adapter trajectory: each agent's slot keeps its own cache across its turns and prefills
  only what the other agents appended since (NonShared's token count);
- ``llama-cpp-q4_0``: the same with 4-bit weights (``llama-quantize`` from the f32 file);
- ``llama-cpp-f32-1slot`` / ``llama-cpp-q8_0-1slot``: one slot for every agent; llama.cpp clears a
  slot's cache when the next request's adapters differ, so every adapter switch recomputes the
  trajectory.

The RAM prompt cache is off (``--cache-ram 0``): it restores a prompt's cache computed under one
adapter for a request under another (``benchmarks/llama_cpp_reuse.py`` shows the wrong tokens that
gives), and it would also carry a replay's cache into the next repeat. Each replay starts by
erasing every slot. Times are llama-server's own (``timings``: ``prompt_ms`` is the TTFT,
``predicted_ms`` the decode), so HTTP costs llama.cpp nothing here. Its KV cache is llama.cpp's
default f16; ``kv_bytes`` counts the tokens its slots hold at 2 bytes a value. On a CPU with AMX
the servers run with ``--no-repack``: llama.cpp's AMX-repacked quantized weights crash llama-server
as it loads the LoRA adapters.

Nothing of llama.cpp is committed or installed by ``make install``: ``make llama-cpp`` builds
llama-server from the tree llama-cpp-python vendors (``benchmarks/llama_cpp/install.sh``) into
``.llama-cpp/`` or ``$PRECACHE_LLAMA_CPP``; without it the baseline is refused with that command.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from precache.bench.replay import Replay
from precache.bench.trace import Trace, TraceError
from precache.engine.outputs import Turn
from precache.errors import PrecacheError

logger = logging.getLogger(__name__)

#: environment variable naming the folder ``make llama-cpp`` built (default ``.llama-cpp``)
ENV_DIR = "PRECACHE_LLAMA_CPP"
DEFAULT_DIR = ".llama-cpp"
BASELINE = "llama-cpp"
#: configuration name -> (GGUF weight type, one slot per agent)
CONFIGS = {
    "llama-cpp-f32": ("f32", True),
    "llama-cpp-f32-1slot": ("f32", False),
    "llama-cpp-q8_0": ("q8_0", True),
    "llama-cpp-q8_0-1slot": ("q8_0", False),
    "llama-cpp-q4_0": ("q4_0", True),
}
#: weight types the converter does not write: llama-quantize makes them from the f32 GGUF
QUANTIZED_TYPES = {"q4_0": "Q4_0"}
#: bytes of one K or V value in llama.cpp's default cache type (f16)
KV_VALUE_BYTES = 2
START_TIMEOUT_S = 120.0


class LlamaCppMissingError(PrecacheError):
    """The llama.cpp baseline was asked for, but llama-server is not built."""


@dataclass(frozen=True)
class LlamaCppTree:
    """A built llama.cpp: ``server`` (llama-server) and the converters' folder ``src``."""

    root: Path
    server: Path
    src: Path

    @property
    def version(self) -> str:
        """The llama-cpp-python sdist the tree came from (its folder name)."""
        return self.src.resolve().parent.parent.name


def find_llama_cpp(root: str | os.PathLike | None = None) -> LlamaCppTree:
    """The llama.cpp that ``make llama-cpp`` built under ``root``, ``$PRECACHE_LLAMA_CPP``,
    ``.llama-cpp`` in the working directory, or ``.llama-cpp`` in the checkout an editable install
    runs from.

    Raises:
        LlamaCppMissingError: no llama-server or converter there (the message says how to build it).
    """
    if root is None and not os.environ.get(ENV_DIR) and not Path(DEFAULT_DIR).is_dir():
        # an editable install run from elsewhere: the checkout's .llama-cpp, where make put it
        checkout = Path(__file__).resolve().parents[2] / DEFAULT_DIR
        root = checkout if checkout.is_dir() else None
    base = Path(root or os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser().resolve()
    server = base / "build" / "bin" / "llama-server"
    src = base / "src"
    missing = [
        p for p in (server, src / "convert_hf_to_gguf.py", src / "convert_lora_to_gguf.py") if not p.exists()
    ]
    if missing:
        raise LlamaCppMissingError(
            f"the llama-cpp baseline needs llama.cpp built under {base} (missing {missing[0]}): run "
            f"`make llama-cpp` (about 5 minutes on 2 cores), or set {ENV_DIR} to a folder it built"
        )
    return LlamaCppTree(base, server, src)


def _cache_dir() -> Path:
    return Path(os.environ.get("PRECACHE_CACHE", Path.home() / ".cache" / "precache")) / "llama-cpp"


def _fingerprint(*paths: Path) -> str:
    """Hash of each file's path, size and modification time under ``paths`` (a converted file is
    rebuilt when its source changes)."""
    h = hashlib.sha256()
    for path in paths:
        for f in (
            sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
        ):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:20]


def _run_converter(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PrecacheError(f"llama.cpp's converter failed on {what}:\n{tail}")


def _staged_checkpoint(checkpoint: Path, into: Path) -> Path:
    """``checkpoint`` as llama.cpp's converter reads it: the same files, and ``config.json``
    without the ``quantization_config`` that transformers' GGUF loader leaves behind (its weights
    are already dequantized to fp32 there)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "config.json" and not (into / f.name).exists():
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    (into / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return into


def _converted(out: Path, checkpoint: Path, args: list[str], what: str) -> Path:
    """``out``, written once by a llama.cpp converter run as ``args`` plus the staged
    ``checkpoint`` folder's path (``{staged}`` in ``args``) and ``--outfile``."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            staged = _staged_checkpoint(checkpoint, Path(tmp) / "checkpoint")
            part = out.with_suffix(".part")
            filled = [str(staged) if x == "{staged}" else x for x in args]
            _run_converter([*filled, "--outfile", str(part)], what)
            part.rename(out)
    return out


def gguf_model(tree: LlamaCppTree, checkpoint: str | os.PathLike, weight_type: str) -> Path:
    """The HF ``checkpoint`` folder converted by ``convert_hf_to_gguf.py --outtype weight_type``,
    cached under ``~/.cache/precache/llama-cpp``.

    Raises:
        PrecacheError: the converter failed (its last lines of stderr in the message).
    """
    checkpoint = Path(checkpoint)
    out = _cache_dir() / f"model-{_fingerprint(checkpoint)}-{tree.version}-{weight_type}.gguf"
    if weight_type in QUANTIZED_TYPES:  # llama-quantize over the f32 file
        if not out.exists():
            source = gguf_model(tree, checkpoint, "f32")
            quantize = tree.server.parent / "llama-quantize"
            part = out.with_suffix(".part")
            proc = subprocess.run(
                [str(quantize), str(source), str(part), QUANTIZED_TYPES[weight_type]],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                raise PrecacheError(f"llama-quantize failed on {checkpoint} ({weight_type}):\n{tail}")
            part.rename(out)
        return out
    args = [str(tree.src / "convert_hf_to_gguf.py"), "{staged}", "--outtype", weight_type]
    return _converted(out, checkpoint, args, f"{checkpoint} ({weight_type})")


def gguf_adapter(tree: LlamaCppTree, adapter: str | os.PathLike, checkpoint: str | os.PathLike) -> Path:
    """The PEFT ``adapter`` folder converted by ``convert_lora_to_gguf.py`` (f32) against ``checkpoint``.

    Raises:
        PrecacheError: the converter failed.
    """
    adapter, checkpoint = Path(adapter), Path(checkpoint)
    out = _cache_dir() / f"lora-{_fingerprint(adapter, checkpoint)}-{tree.version}.gguf"
    args = [str(tree.src / "convert_lora_to_gguf.py"), "--base", "{staged}", "--outtype", "f32", str(adapter)]
    return _converted(out, checkpoint, args, str(adapter))


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


class LlamaCppAgents:
    """Agents as llama.cpp LoRAs on one llama-server: each turn is one ``/completion`` of the whole
    trajectory (token ids) with the agent's adapter at scale 1 and the others at 0, greedy,
    exactly ``decode_len`` tokens (``ignore_eos``), in the agent's slot (``per_agent_slots``) or
    slot 0.

    ``kv_value_bytes_per_token``: bytes of one token's K and V over all layers at one byte a value
    (``2 * layers * kv_heads * head_dim``); multiplied by :data:`KV_VALUE_BYTES`.
    """

    def __init__(
        self,
        server: LlamaServer,
        name: str,
        agents: list[str],
        per_agent_slots: bool,
        kv_values_per_token: int,
    ):
        self.server, self.name, self.agents = server, name, list(agents)
        self.per_agent_slots = per_agent_slots
        self.kv_token_bytes = kv_values_per_token * KV_VALUE_BYTES

    def _slot(self, agent: str) -> int:
        return self.agents.index(agent) if self.per_agent_slots else 0

    def replay(self, trace: Trace, stream: list[list[int]]) -> Replay:
        """Replay ``trace`` like :func:`precache.bench.replay.replay_engine`.

        Raises:
            TraceError: an agent has no adapter here.
        """
        unknown = [a for a in trace.agents if a not in self.agents]
        if unknown:
            raise TraceError(f"{self.name}: no adapter for agent(s) {', '.join(unknown)}")
        self.server.erase_slots()
        trajectory: list[int] = []
        held: dict[int, int] = {}
        records, peak = [], 0
        for turn, ids in zip(trace.turns, stream, strict=True):
            trajectory.extend(ids)
            agent_id = self.agents.index(turn.agent)
            slot = self._slot(turn.agent)
            answer = self.server.complete(trajectory, turn.decode_len, slot, agent_id, len(self.agents))
            tokens = [int(t) for t in answer["tokens"]]
            if len(tokens) != turn.decode_len:
                raise PrecacheError(f"{self.name}: {len(tokens)} tokens for a {turn.decode_len}-token turn")
            timings = answer["timings"]
            trajectory.extend(tokens)
            held[slot] = int(answer.get("tokens_cached", len(trajectory)))
            kv = sum(held.values()) * self.kv_token_bytes
            peak = max(peak, kv)
            records.append(
                Turn(
                    agent=turn.agent,
                    token_ids=tokens,
                    stop_reason="length",
                    ttft_s=timings["prompt_ms"] / 1000,
                    decode_s=timings["predicted_ms"] / 1000,
                    prefill_tokens=int(timings["prompt_n"]),
                    kv_bytes=kv,
                )
            )
        return Replay(self.name, trace.total_tokens, records, peak)


def parse_baselines(spec: str) -> list[str]:
    """``hf-peft,llama-cpp`` -> runner names: ``llama-cpp`` is every configuration of
    :data:`CONFIGS`; a configuration may also be named alone.

    Raises:
        PrecacheError: an unknown name (the known ones listed).
    """
    known = ("hf-peft", BASELINE, *CONFIGS)
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part not in known:
            raise PrecacheError(f"--baselines: unknown baseline '{part[:40]}' (known: {', '.join(known)})")
        for name in CONFIGS if part == BASELINE else (part,):
            if name not in names:
                names.append(name)
    return names


@contextlib.contextmanager
def llama_cpp_runners(
    configs: list[str], checkpoint, adapters: dict[str, str], model_config, trace: Trace, threads: int
):
    """Start one llama-server per configuration in ``configs`` and yield ``{name: runner}``; every
    server stops on exit.

    ``model_config``: the engine's :class:`~precache.models.config.ModelConfig` (for KV bytes).

    Raises:
        LlamaCppMissingError: llama.cpp is not built.
        PrecacheError: a conversion or a server start failed.
    """
    if not configs:  # nothing asked of llama.cpp: it need not be built
        yield {}
        return
    tree = find_llama_cpp()
    agents = list(adapters)
    loras = [gguf_adapter(tree, adapters[a], checkpoint) for a in agents]
    slot_context = -(-(trace.total_tokens + 64) // 256) * 256
    kv_values = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
    with contextlib.ExitStack() as stack:
        runners = {}
        for name in configs:
            weight_type, per_agent = CONFIGS[name]
            server = stack.enter_context(
                LlamaServer(
                    tree,
                    gguf_model(tree, checkpoint, weight_type),
                    loras,
                    len(agents) if per_agent else 1,
                    slot_context,
                    threads,
                )
            )
            runners[name] = LlamaCppAgents(server, name, agents, per_agent, kv_values).replay
        yield runners
