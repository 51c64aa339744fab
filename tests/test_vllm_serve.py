"""``vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128``, the command users deploy, driven by the ``openai`` client.

One server for the module: vLLM's own ``vllm`` command (the README's line) on a tiny random Llama (2 layers,
head_dim 64, byte-level tokenizer: one token per character, so prompt lengths are exact). Its greedy outputs are
held to the offline engine's (``LLM.generate`` in a child process, the same engine arguments) for the same
prompts: a streamed completion, a chat completion, 8 concurrent requests whose prompts and outputs cross tile
boundaries, and requests after a client cancelled a stream mid-way. On a CUDA machine the server runs with
vLLM's default compilation (decode CUDA graphs); on the CPU with ``--enforce-eager``.

``python tests/test_vllm_serve.py MODEL_DIR REQUESTS.json OUT.json`` is the offline engine's side.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PRESET = "kvarn_k4v2_g128"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512
GPU_SHARE = 0.3
"""On a CUDA machine, the fraction of GPU memory each engine (the server, the offline one) takes."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a rag "
    "folded into a square. For forty years the lamp had turned above the harbour, and for forty years he had "
    "written the same three lines in the log: the time of lighting, the state of the sea, and the ships that "
    "passed. Most nights there were none. The fishing fleet had moved south after the cannery closed. "
)


def _prompt(n: int, shift: int = 0) -> str:
    """``n`` characters (``n`` tokens) of the passage, starting ``shift`` characters in."""
    text = PASSAGE * (1 + (n + shift) // len(PASSAGE))
    return text[shift : shift + n]


# 8 concurrent requests: prompts of 100-310 tokens and 70 generated, so prompts and outputs cross the 128- and
# 256-token tile boundaries at different steps of one batch
CONCURRENT = [(_prompt(100 + 30 * i, shift=17 * i), 70) for i in range(8)]
STREAMED = (_prompt(120, shift=3), 40)  # the stream crosses the first tile boundary at its 9th token
AFTER_CANCEL = [(_prompt(140 + 50 * i, shift=5 + i), 24) for i in range(3)]
CHAT = [{"role": "user", "content": _prompt(150, shift=40)}]
CHAT_TOKENS = 20
HELD = (_prompt(200, shift=11), 250)  # long enough that it is still running when /metrics is read


def _serve_args(model_dir: pathlib.Path, template: pathlib.Path) -> list[str]:
    args = [str(model_dir), "--kv-cache-dtype", PRESET, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8"]
    args += ["--served-model-name", SERVED_NAME, "--chat-template", str(template), "--seed", "0"]
    if not _cuda():
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(16 * 2**20)]
    else:  # the offline engine runs beside the server
        args += ["--gpu-memory-utilization", str(GPU_SHARE)]
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _vllm_command() -> list[str]:
    """The ``vllm`` console script of this interpreter's environment, or vLLM's CLI module where none is installed."""
    script = pathlib.Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _engine_env() -> dict[str, str]:
    """One OpenMP thread: on a small shared CI machine spinning threads make every process several times slower."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("KVARN_KEY_SMOOTHING", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers; a group already gone is fine."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: pathlib.Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def alive(self) -> None:
        assert self.proc.poll() is None, f"vllm serve exited:\n{self.log.read_text()[-4000:]}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        """Prometheus gauges and counters by name (labels dropped, values of one name summed)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
        return values

    def wait_idle(self, timeout: float = 120) -> dict[str, float]:
        """Metrics once no request runs or waits."""
        deadline = time.time() + timeout
        while True:
            self.alive()
            m = self.metrics()
            if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0:
                return m
            assert time.time() < deadline, f"requests still running after {timeout} s: {m}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    pytest.importorskip("transformers")
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    port, log = _free_port(), tmp / "serve.log"
    cmd = [*_vllm_command(), "serve", *_serve_args(model_dir, template), "--host", "127.0.0.1", "--port", str(port)]
    print(f"starting: {' '.join(cmd)}", flush=True)
    start = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=_engine_env())
    srv = Server(proc, port, log)
    try:
        deadline = time.time() + 600
        while True:
            srv.alive()
            try:
                with urllib.request.urlopen(srv.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"vllm serve not ready in 600 s:\n{log.read_text()[-4000:]}"
            time.sleep(2)
        print(f"vllm serve ready in {time.time() - start:.0f} s", flush=True)
        yield srv
    finally:
        _kill_group(proc)


@pytest.fixture(scope="module")
def served(server):
    """Every request of the module against the server, in order; what each returned."""
    client = server.client()
    out: dict[str, object] = {}

    stream = client.completions.create(
        model=SERVED_NAME, prompt=STREAMED[0], max_tokens=STREAMED[1], temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    out["streamed"] = {"chunks": len(pieces), "text": "".join(pieces)}

    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    out["chat"] = {"text": chat.choices[0].message.content, "usage": chat.usage.model_dump()}

    def complete(req):
        prompt, n = req
        r = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )
        return {"text": r.choices[0].text, "usage": r.usage.model_dump(), "finish": r.choices[0].finish_reason}

    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        out["concurrent"] = list(pool.map(complete, CONCURRENT))
    out["metrics_after_concurrent"] = server.wait_idle()

    # a request held mid-stream: it has generated tokens and has more to go, so its blocks are in use while the
    # metrics are read (a short request can finish between two reads of /metrics)
    held = client.completions.create(
        model=SERVED_NAME, prompt=HELD[0], max_tokens=HELD[1], temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage_seen, got, tokens = 0.0, 0, None
    for chunk in held:
        got += bool(chunk.choices)
        tokens = chunk.usage.completion_tokens if chunk.usage is not None else tokens
        if got >= 5 and usage_seen == 0:
            usage_seen = server.metrics().get("vllm:kv_cache_usage_perc", 0.0)
    out["usage_while_running"], out["held_chunks"], out["held_tokens"] = usage_seen, got, tokens
    out["metrics_after_held"] = server.wait_idle()

    cancelled = client.completions.create(
        model=SERVED_NAME, prompt=_prompt(200, shift=9), max_tokens=300, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    got = 0
    for chunk in cancelled:
        got += bool(chunk.choices)
        if got == 5:
            break
    cancelled.close()
    out["cancelled_chunks"] = got
    out["metrics_after_cancel"] = server.wait_idle()
    out["after_cancel"] = [complete(req) for req in AFTER_CANCEL]
    server.alive()
    return out


@pytest.fixture(scope="module")
def offline(model_dir, tmp_path_factory, served):
    """The offline engine's greedy texts for the same prompts (a child process: vLLM's engine is spawn-safe there)."""
    tmp = tmp_path_factory.mktemp("offline")
    requests = {
        "streamed": [STREAMED],
        "concurrent": CONCURRENT,
        "after_cancel": AFTER_CANCEL,
        "chat": [(CHAT, CHAT_TOKENS)],
    }
    (tmp / "requests.json").write_text(json.dumps(requests))
    cmd = [sys.executable, __file__, str(model_dir), str(tmp / "requests.json"), str(tmp / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=_engine_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads((tmp / "out.json").read_text())


def test_the_start_up_log_states_kvarn_capacity(server, served):
    log = server.log.read_text()
    m = re.search(
        rf"KVarN {PRESET} KV cache: \d+ blocks of 128 tokens = (\d+) tokens .*?: ([0-9.]+)x the capacity", log
    )
    assert m, log[-4000:]
    assert int(m.group(1)) > 0 and float(m.group(2)) > 3.0


def test_a_streamed_completion_arrives_in_pieces(served):
    assert served["streamed"]["chunks"] > 1
    assert served["streamed"]["text"]


def test_a_chat_completion_is_answered(served):
    chat = served["chat"]
    assert chat["usage"]["completion_tokens"] == CHAT_TOKENS
    assert chat["usage"]["prompt_tokens"] > 128  # the chat template's prompt fills more than a tile
    assert chat["text"]


def test_eight_concurrent_requests_across_tile_boundaries_finish(served):
    for (prompt, n), got in zip(CONCURRENT, served["concurrent"], strict=True):
        assert got["usage"]["prompt_tokens"] == len(prompt)
        assert got["usage"]["completion_tokens"] == n
        assert got["finish"] == "length"
    spans = [(len(p), len(p) + n) for p, n in CONCURRENT]
    assert sum(a // 128 != b // 128 for a, b in spans) >= 4  # outputs cross tile boundaries


def test_metrics_report_kv_cache_usage_and_release_it(served):
    # a chunk may carry several tokens where the engine outruns the client (on a GPU, while /metrics is read)
    assert served["held_tokens"] == HELD[1] and served["held_chunks"] > 5
    assert served["usage_while_running"] > 0  # a running request's blocks are counted
    for key in ("metrics_after_concurrent", "metrics_after_held", "metrics_after_cancel"):
        m = served[key]
        assert "vllm:kv_cache_usage_perc" in m, sorted(m)
        assert m["vllm:kv_cache_usage_perc"] == 0.0, (key, m["vllm:kv_cache_usage_perc"])  # nothing held when idle


def test_a_cancelled_stream_is_aborted_and_the_server_keeps_serving(server, served):
    assert served["cancelled_chunks"] == 5
    for (prompt, n), got in zip(AFTER_CANCEL, served["after_cancel"], strict=True):
        assert got["usage"]["completion_tokens"] == n and got["usage"]["prompt_tokens"] == len(prompt)
    # the cancelled request did not run to its 300 tokens: the generation counter stops short of it
    m = served["metrics_after_cancel"]
    generated = sum(n for _, n in CONCURRENT) + STREAMED[1] + CHAT_TOKENS + HELD[1]
    assert m["vllm:generation_tokens_total"] < generated + 300, m["vllm:generation_tokens_total"]
    server.alive()


def test_greedy_outputs_equal_the_offline_engine(served, offline):
    assert served["streamed"]["text"] == offline["streamed"][0]
    assert served["chat"]["text"] == offline["chat"][0]
    assert [r["text"] for r in served["concurrent"]] == offline["concurrent"]
    assert [r["text"] for r in served["after_cancel"]] == offline["after_cancel"]


def _offline(model_dir: str, requests_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    import kvarn.integration.vllm as kvarn_vllm

    kvarn_vllm.register()
    requests = json.loads(pathlib.Path(requests_path).read_text())
    kw = dict(kv_cache_dtype=PRESET, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0)
    if not _cuda():
        kw |= dict(enforce_eager=True, kv_cache_memory_bytes=16 * 2**20)
    else:
        kw |= dict(gpu_memory_utilization=GPU_SHARE)
    llm = LLM(model=model_dir, **kw)
    out = {}
    for name, reqs in requests.items():
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        if name == "chat":
            got = llm.chat([msgs for msgs, _ in reqs], params, chat_template=CHAT_TEMPLATE)
        else:
            got = llm.generate([p for p, _ in reqs], params)
        out[name] = [g.outputs[0].text for g in got]
    pathlib.Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    _offline(*sys.argv[1:4])
