"""Serving under load: many streaming HTTP clients against a real `kiln serve`, one of them
scraping /metrics the whole time; optionally the same load against the server code of
another git ref, round by round.

    python bench/serving_load.py ARTIFACT [--compare-ref b7f96e0] [--rounds 3] [--streams 64] [--out bench/out]

Each round starts a fresh server (`kiln serve ARTIFACT --host 127.0.0.1 --port <free>`),
waits for GET /health, sends one small warm-up completion, then runs the workload:

* --streams clients (one asyncio loop, httpx) post to /v1/completions at once with
  "stream": true, temperature 0, ignore_eos. Prompts are 8-400 common English words
  (about as many tokens), max_tokens 16-128, both drawn from a seeded RNG, so every
  system and round gets the identical workload.
* 25% of the clients (seeded) disconnect mid-stream: they ask for max_tokens 256 and close
  the response after k token events (k in 1..10), so their request cannot legitimately
  have finished when they leave; the server should abort it.
* A scraper GETs /metrics every 50 ms and /health every 250 ms (one request in flight
  each) and records every latency, until the clients are done.

A fresh server per round keeps rounds independent: the workload repeats, and a reused
server would serve later rounds' prompts from its prefix cache. The benchmark's own client
shares the host's cores with the server; it only reads lines and parses small JSON.

Numbers (per round; the table shows the median over rounds of each system):

* ttft p50 / p99: time from sending a request to its first SSE data event.
* silence p99: per stream, the longest gap between consecutive data events (counting
  send -> first event); p99 over streams. What a user sees as a frozen stream.
* mid-stream silence p99: the same without send -> first event: how long a stream that
  has started can freeze (the first silence also holds the wait for a sequence slot).
* step (gap median): median gap between consecutive events of one stream, over all streams.
  Near 0 when a server flushes a stream's events in bursts (then "silence / median gap" is
  meaningless); "event gaps < 1 ms" is the share of gaps that arrived in one burst.
* step (server): mean engine step, from the kiln_step_seconds _sum/_count deltas in
  /metrics before and after the round.
* silence p99 in steps: silence p99 / each step estimate. About 1 for a server that keeps
  every running stream moving; the queueing of requests beyond max-num-seqs adds to it.
* /metrics and /health latency p50 / p99 / max: the scraper's request times; a server
  whose event loop is blocked answers these late.
* tok/s (server): kiln_generated_tokens_total delta / the round's wall time (first send to
  last client done); tok/s (events): token events the clients received / wall time;
  model tok/s: kiln_processed_tokens_total delta (prompt + generated tokens run through
  the model) / wall time. Prefill of the ~13k prompt tokens dominates the 64-stream round.
* disconnects: clients that closed their stream as planned; aborted / finished: the
  server's kiln_requests_aborted_total / kiln_requests_finished_total deltas (read once
  /health shows nothing running or waiting, bounded). Expect aborted == disconnects.
* lost / corrupted: a non-disconnecting stream without [DONE], or with an error event, an
  HTTP error or a malformed event (bad JSON, or not {id, choices[0].index == 0,
  choices[0].text: str}); a disconnecting stream with an error or malformed event, or that
  ended before its k-th event. "finished early" counts disconnecting streams that saw
  [DONE] before leaving (possible only if the server ignores max_tokens / ignore_eos).
* text mismatches: completed streams whose text differs from the same client's text in
  the first round that served (the current tree's, unless it failed; greedy decoding, but
  a different batch mix can change float rounding and so, rarely, a token).
* failed rounds: rounds whose server did not start or refused the warm-up request (a tree
  under rewrite may not serve); their server log is kept under <out>.

--compare-ref REF checks REF out into a detached worktree (/tmp/kiln-ref-<REF>, reused when
present) and runs its server through a shim import root (kiln/ with links to the
worktree's runtime, cli, compiler and bench) on PYTHONPATH, with the editable install's
finder taken off sys.meta_path first; this tree runs the same way, so the two differ only
in the code. Before the rounds, each system's interpreter setup is checked to import its
own tree's files (printed). Rounds alternate A, B, A, B so host noise hits both.
Writes <out>/serving_load.json: every round's numbers, every client's events and text,
every scrape's latency. No number is asserted; this prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only: the benchmark never exposes a server
PACKAGES = ("runtime", "cli", "compiler", "bench")  # setup.py's roots under kiln.

HEALTH_WAIT_S = 180.0  # artifact load on a busy 2-core host
HEALTH_ERROR_GRACE_S = 15.0  # how long /health may answer errors before the server counts as broken
STOP_WAIT_S = 20.0
SETTLE_WAIT_S = 20.0  # after the clients: until the server has nothing running or waiting
WARMUP_TIMEOUT_S = 120.0
METRICS_EVERY_S = 0.05
HEALTH_EVERY_S = 0.25
SCRAPE_TIMEOUT_S = 30.0
BURST_GAP_S = 1e-3  # events this close came in one read: the server sent them as a burst
MAX_SCRAPES = 200_000  # bounds the scraper loops beyond the round deadline

WORDS = ("the of and to in is was for on that with as by at from his her they this which "
         "river mountain garden window morning evening letter market village teacher doctor "
         "summer winter music story paper engine bridge forest ocean station kitchen "
         "quickly slowly carefully often never always almost together between under over "
         "walks reads builds carries follows remembers opens closes watches answers "
         "green quiet bright heavy simple early final small large ancient modern").split()


# ---------------------------------------------------------------- workload

@dataclass(frozen=True)
class ClientSpec:
    index: int
    prompt: str
    prompt_words: int
    max_tokens: int
    disconnect_after: int | None  # token events read before closing; None: reads to the end


def make_workload(streams: int, seed: int, disconnect_fraction: float = 0.25) -> list[ClientSpec]:
    rng = random.Random(seed)
    leavers = set(rng.sample(range(streams), round(streams * disconnect_fraction)))
    specs = []
    for i in range(streams):
        n = rng.randint(8, 400)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        out = rng.randint(16, 128)
        k = rng.randint(1, 10)  # drawn for every client so the other draws do not depend on who leaves
        if i in leavers:
            # 256 tokens: far more than k events, so the request is still running when the client leaves
            specs.append(ClientSpec(i, prompt, n, 256, k))
        else:
            specs.append(ClientSpec(i, prompt, n, out, None))
    return specs


# ---------------------------------------------------------------- systems and servers

@dataclass
class System:
    name: str  # "current" or "ref <REF>"
    root: Path  # checkout whose runtime/ cli/ compiler/ bench/ are served
    shim: Path  # import root put on PYTHONPATH
    describe: str = ""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(self.shim)
        return env


# Run before anything imports kiln: drops the editable install's meta-path finder, which maps
# kiln.* onto the installed checkout and may be sorted ahead of the path-based finder (a .pth
# in the venv does that), so that the shim on PYTHONPATH alone decides which code runs.
PRELUDE = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
           "(getattr(f, '__module__', '') or '').startswith('__editable___kiln')]; ")


def build_shim(root: Path) -> Path:
    """kiln/ with root's kiln/__init__.py and links to root's packages: with PRELUDE,
    `import kiln.runtime` finds root's code through PYTHONPATH."""
    shim = Path(tempfile.mkdtemp(prefix="kiln-shim-"))
    (shim / "kiln").mkdir()
    shutil.copy2(root / "kiln" / "__init__.py", shim / "kiln" / "__init__.py")
    for pkg in PACKAGES:
        if (root / pkg).is_dir():
            (shim / "kiln" / pkg).symlink_to(root / pkg, target_is_directory=True)
    return shim


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def ref_worktree(ref: str) -> Path:
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = Path(tempfile.gettempdir()) / f"kiln-ref-{ref.replace('/', '_')}"
    if not path.exists():
        git("worktree", "add", "--detach", str(path), commit)
    head = git("rev-parse", "HEAD", cwd=path)
    if head != commit:
        raise SystemExit(f"{path} is at {head[:10]}, not {ref} ({commit[:10]}); remove it "
                         f"(git worktree remove {path}) and rerun")
    return path


def verify_code(system: System, cwd: Path) -> str:
    """Which files a server started with this env imports: the same interpreter, env and cwd."""
    probe = PRELUDE + ("import os, kiln, kiln.runtime, kiln.cli.main, kiln.runtime.server.app as a;"
             "print(os.path.realpath(kiln.runtime.__file__)); print(os.path.realpath(a.__file__))")
    out = subprocess.run([sys.executable, "-c", probe], env=system.env(), cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"{system.name}: cannot import its kiln: {out.stderr.strip()[-2000:]}")
    files = out.stdout.split()
    expected = str(system.root.resolve())
    if not all(f.startswith(expected + os.sep) for f in files):
        raise SystemExit(f"{system.name}: imports {files}, not code under {expected}")
    return ", ".join(files)


def describe_tree(root: Path) -> str:
    head = git("rev-parse", "--short", "HEAD", cwd=root)
    dirty = git("status", "--porcelain", "--", "kiln", *PACKAGES, cwd=root).splitlines()
    return f"{head}" + (f" + {len(dirty)} changed/untracked files" if dirty else " (clean)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """One `kiln serve` subprocess of a system; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, system: System, artifact: Path, log_path: Path, cwd: Path, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-c", PRELUDE + "from kiln.cli.main import main; main()", "serve", str(artifact),
               "--host", HOST, "--port", str(self.port), "--log-level", "warning", *extra]
        self._log = open(log_path, "w")  # a file, not a pipe: a full pipe would block the server
        # cwd: a folder without kiln/ in it, since python -c puts the cwd first on sys.path
        self.proc = subprocess.Popen(cmd, env=system.env(), cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = HEALTH_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        failing_since = None  # a server that is up but keeps answering errors will not recover
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}")
                try:
                    status = client.get(self.base + "/health").status_code
                except httpx.HTTPError:
                    status = None
                if status == 200:
                    return
                if status is not None:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > HEALTH_ERROR_GRACE_S:
                        raise RuntimeError(f"/health answers {status}")
                time.sleep(0.25)
        raise RuntimeError(f"no healthy /health within {timeout:.0f} s")

    def log_tail(self, chars: int = 2000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_WAIT_S)
        self._log.close()
        return self.proc.returncode


# ---------------------------------------------------------------- metrics text

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")


def parse_prometheus(text: str) -> dict[str, float]:
    """name -> value, summed over label sets; comments and unparsable lines skipped. Covers
    the hand-written renderer and prometheus_client (labels, trailing timestamps, _created)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def counter(sample: dict[str, float], name: str) -> float | None:
    """A counter by its exposed name, with or without the _total suffix."""
    for key in (name, name.removesuffix("_total"), name + "_total"):
        if key in sample:
            return sample[key]
    return None


def delta(before: dict, after: dict, name: str) -> float | None:
    a, b = counter(before, name), counter(after, name)
    return None if a is None or b is None else b - a


# ---------------------------------------------------------------- one client

@dataclass
class ClientResult:
    index: int
    disconnect_after: int | None
    max_tokens: int
    prompt_words: int
    sent: float = 0.0  # seconds from the round's start
    events: list[float] = field(default_factory=list)  # arrival of each data: line (incl. [DONE])
    token_events: int = 0
    done: bool = False
    finish_reason: str | None = None
    text: str = ""
    http_status: int | None = None
    errors: list[str] = field(default_factory=list)
    malformed: int = 0
    disconnected: bool = False
    ended: float | None = None


def check_event(obj) -> str | None:
    """None if obj is a well-formed completion chunk, else what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return "no id"
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices[0]"
    if choices[0].get("index") != 0:
        return f"choices[0].index {choices[0].get('index')!r}"
    if not isinstance(choices[0].get("text"), str):
        return "choices[0].text not a string"
    return None


def handle_data(res: ClientResult, payload: str) -> None:
    if payload == "[DONE]":
        res.done = True
        return
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        res.malformed += 1
        res.errors.append(f"bad JSON: {payload[:120]!r}")
        return
    if isinstance(obj, dict) and "error" in obj:
        res.errors.append(f"error event: {json.dumps(obj['error'])[:300]}")
        return
    problem = check_event(obj)
    if problem:
        res.malformed += 1
        res.errors.append(f"malformed event ({problem}): {payload[:120]!r}")
        return
    choice = obj["choices"][0]
    res.token_events += 1
    res.text += choice["text"]
    if choice.get("finish_reason"):
        res.finish_reason = choice["finish_reason"]


async def read_stream(client: httpx.AsyncClient, base: str, body: dict, spec: ClientSpec, res: ClientResult,
                      t0: float) -> None:
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        res.http_status = resp.status_code
        if resp.status_code != 200:
            res.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            return
        async for line in resp.aiter_lines():
            # SSE comments (": ping") and blank separators carry no event
            if not line.startswith("data:"):
                continue
            res.events.append(time.perf_counter() - t0)
            handle_data(res, line[5:].strip())
            if spec.disconnect_after is not None and res.token_events >= spec.disconnect_after:
                # leaving the block closes the unread response, hence its connection
                res.disconnected = True
                return


async def run_client(client: httpx.AsyncClient, base: str, spec: ClientSpec, t0: float, deadline: float
                     ) -> ClientResult:
    res = ClientResult(spec.index, spec.disconnect_after, spec.max_tokens, spec.prompt_words)
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    res.sent = time.perf_counter() - t0
    try:
        await asyncio.wait_for(read_stream(client, base, body, spec, res, t0),
                               max(deadline - time.perf_counter(), 0.0))
    except asyncio.TimeoutError:
        res.errors.append("round deadline reached")
    except httpx.HTTPError as err:
        res.errors.append(f"{type(err).__name__}: {err}")
    finally:
        res.ended = time.perf_counter() - t0
    return res


def is_lost(res: ClientResult) -> bool:
    if res.disconnect_after is None:
        return not res.done or bool(res.errors) or res.malformed > 0
    # a leaver is lost if it could not read its k events cleanly before leaving
    return bool(res.errors) or res.malformed > 0 or not (res.disconnected or res.done)


def longest_silence(res: ClientResult, from_send: bool = True) -> float | None:
    """Longest gap between consecutive events; from_send counts send -> first event too
    (queueing), else only gaps once the stream has started (stalls of a running stream)."""
    stamps = [res.sent, *res.events] if from_send else res.events
    return max((b - a for a, b in zip(stamps, stamps[1:])), default=None)


# ---------------------------------------------------------------- scraper

async def scrape(client: httpx.AsyncClient, url: str, every: float, stop: asyncio.Event, t0: float,
                 deadline: float) -> list[list]:
    """[t, latency_s, status] per GET; one in flight, the next one `every` s after the last
    started (at once if that one took longer)."""
    samples: list[list] = []
    for _ in range(MAX_SCRAPES):
        if stop.is_set() or time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        try:
            status = (await client.get(url)).status_code
        except httpx.HTTPError as err:
            status = type(err).__name__
        samples.append([start - t0, time.perf_counter() - start, status])
        try:
            await asyncio.wait_for(stop.wait(), max(every - (time.perf_counter() - start), 0.0))
        except asyncio.TimeoutError:
            pass
    return samples


# ---------------------------------------------------------------- one round

def get_json(base: str, path: str, timeout: float = 10.0):
    with httpx.Client(timeout=timeout) as client:
        resp = client.get(base + path)
        resp.raise_for_status()
        return resp.json() if path != "/metrics" else resp.text


def warm_up(base: str) -> None:
    with httpx.Client(timeout=WARMUP_TIMEOUT_S) as client:
        client.post(base + "/v1/completions", json={"prompt": "Warm up:", "max_tokens": 4, "temperature": 0.0}
                    ).raise_for_status()


def settle(base: str) -> float:
    """Wait (bounded) until /health shows nothing running or waiting, so that the aborts of
    the disconnected clients are counted; returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < SETTLE_WAIT_S:
        try:
            health = get_json(base, "/health")
        except (httpx.HTTPError, ValueError):
            health = {}
        if "running" not in health or "waiting" not in health:  # another server's shape: just give it time
            time.sleep(2.0)
            break
        if not health["running"] and not health["waiting"]:
            break
        time.sleep(0.25)
    return time.monotonic() - start


async def drive(base: str, specs: list[ClientSpec], round_timeout: float) -> dict:
    t0 = time.perf_counter()
    deadline = t0 + round_timeout
    limits = httpx.Limits(max_connections=len(specs) + 4, max_keepalive_connections=len(specs) + 4)
    timeout = httpx.Timeout(connect=10.0, read=round_timeout, write=10.0, pool=round_timeout)
    stop = asyncio.Event()
    # the scraper has its own connections: it must not wait behind the streams for a pooled one
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as clients, \
            httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as scraper:
        metrics = asyncio.create_task(scrape(scraper, base + "/metrics", METRICS_EVERY_S, stop, t0, deadline))
        health = asyncio.create_task(scrape(scraper, base + "/health", HEALTH_EVERY_S, stop, t0, deadline))
        results = await asyncio.gather(*(run_client(clients, base, s, t0, deadline) for s in specs))
        wall = time.perf_counter() - t0
        stop.set()
        metric_samples, health_samples = await metrics, await health
    return {"wall_s": wall, "clients": results, "metrics_scrapes": metric_samples, "health_scrapes": health_samples}


def run_round(system: System, artifact: Path, specs: list[ClientSpec], round_timeout: float, log_path: Path,
              cwd: Path, server_args: tuple[str, ...] = ()) -> dict:
    server = Server(system, artifact, log_path, cwd, server_args)
    try:
        server.wait_healthy()
        warm_up(server.base)
        before = parse_prometheus(get_json(server.base, "/metrics"))
        driven = asyncio.run(drive(server.base, specs, round_timeout))
        settle_s = settle(server.base)
        after = parse_prometheus(get_json(server.base, "/metrics", timeout=SCRAPE_TIMEOUT_S))
    finally:
        exit_code = server.stop()
    return {**driven, "metrics_before": before, "metrics_after": after, "settle_s": settle_s,
            "server_exit_code": exit_code, "server_log_tail": server.log_tail(4000)}


# ---------------------------------------------------------------- summaries

def pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(raw: dict, reference_texts: dict[int, str] | None) -> dict:
    clients: list[ClientResult] = raw["clients"]
    wall = raw["wall_s"]
    before, after = raw["metrics_before"], raw["metrics_after"]
    ttft = [c.events[0] - c.sent for c in clients if c.events]
    silences = [s for s in map(longest_silence, clients) if s is not None]
    mid_silences = [s for s in (longest_silence(c, from_send=False) for c in clients) if s is not None]
    gaps = [b - a for c in clients for a, b in zip(c.events, c.events[1:])]
    step_sum, step_count = delta(before, after, "kiln_step_seconds_sum"), delta(before, after, "kiln_step_seconds_count")
    server_step = ratio(step_sum, step_count)
    gap_step = statistics.median(gaps) if gaps else None
    silence_p99 = pct(silences, 99)
    metric_lat = [s[1] for s in raw["metrics_scrapes"]]
    health_lat = [s[1] for s in raw["health_scrapes"]]
    generated = delta(before, after, "kiln_generated_tokens_total")
    completed = [c for c in clients if c.disconnect_after is None and c.done]
    mismatches = None
    if reference_texts is not None:
        mismatches = sum(1 for c in completed if c.index in reference_texts and c.text != reference_texts[c.index])
    return {
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "silence_p99_s": silence_p99, "silence_max_s": max(silences, default=None),
        "step_gap_median_s": gap_step, "step_server_mean_s": server_step,
        "burst_gap_fraction": sum(g < BURST_GAP_S for g in gaps) / len(gaps) if gaps else None,
        "silence_p99_in_server_steps": ratio(silence_p99, server_step),
        "silence_p99_in_gap_steps": ratio(silence_p99, gap_step),
        "mid_silence_p99_s": pct(mid_silences, 99),
        "mid_silence_p99_in_server_steps": ratio(pct(mid_silences, 99), server_step),
        "metrics_latency_p50_s": pct(metric_lat, 50), "metrics_latency_p99_s": pct(metric_lat, 99),
        "metrics_latency_max_s": max(metric_lat, default=None), "metrics_scrapes": len(metric_lat),
        "metrics_scrape_failures": sum(1 for s in raw["metrics_scrapes"] if s[2] != 200),
        "health_latency_p50_s": pct(health_lat, 50), "health_latency_p99_s": pct(health_lat, 99),
        "health_latency_max_s": max(health_lat, default=None),
        "tokens_per_s_server": ratio(generated, wall),
        "tokens_per_s_events": sum(c.token_events for c in clients) / wall,
        "processed_tokens_per_s": ratio(delta(before, after, "kiln_processed_tokens_total"), wall),
        "wall_s": wall,
        "disconnects_planned": sum(1 for c in clients if c.disconnect_after is not None),
        "disconnects": sum(1 for c in clients if c.disconnected),
        "server_aborted": delta(before, after, "kiln_requests_aborted_total"),
        "server_finished": delta(before, after, "kiln_requests_finished_total"),
        "server_requests": delta(before, after, "kiln_requests_total"),
        "lost_or_corrupted": sum(1 for c in clients if is_lost(c)),
        "finished_early": sum(1 for c in clients if c.disconnect_after is not None and c.done),
        "malformed_events": sum(c.malformed for c in clients),
        "error_streams": sum(1 for c in clients if c.errors),
        "text_mismatches": mismatches,
        "settle_s": raw["settle_s"],
        "failed": 0,
    }


ROWS = (  # (key, label, scale, format)
    ("ttft_p50_s", "ttft p50 (ms)", 1e3, "{:.0f}"),
    ("ttft_p99_s", "ttft p99 (ms)", 1e3, "{:.0f}"),
    ("silence_p99_s", "longest silence p99 (ms)", 1e3, "{:.0f}"),
    ("silence_max_s", "longest silence max (ms)", 1e3, "{:.0f}"),
    ("mid_silence_p99_s", "mid-stream silence p99 (ms)", 1e3, "{:.0f}"),
    ("step_gap_median_s", "step: median event gap (ms)", 1e3, "{:.1f}"),
    ("step_server_mean_s", "step: server mean (ms)", 1e3, "{:.1f}"),
    ("burst_gap_fraction", "event gaps < 1 ms (share)", 1, "{:.2f}"),
    ("silence_p99_in_server_steps", "silence p99 / server step", 1, "{:.1f}"),
    ("silence_p99_in_gap_steps", "silence p99 / median gap", 1, "{:.1f}"),
    ("mid_silence_p99_in_server_steps", "mid-stream p99 / server step", 1, "{:.1f}"),
    ("metrics_latency_p50_s", "/metrics latency p50 (ms)", 1e3, "{:.1f}"),
    ("metrics_latency_p99_s", "/metrics latency p99 (ms)", 1e3, "{:.0f}"),
    ("metrics_latency_max_s", "/metrics latency max (ms)", 1e3, "{:.0f}"),
    ("metrics_scrapes", "/metrics scrapes", 1, "{:.0f}"),
    ("health_latency_p99_s", "/health latency p99 (ms)", 1e3, "{:.0f}"),
    ("tokens_per_s_server", "tok/s (server counter)", 1, "{:.0f}"),
    ("tokens_per_s_events", "tok/s (client events)", 1, "{:.0f}"),
    ("processed_tokens_per_s", "model tok/s (prefill+decode)", 1, "{:.0f}"),
    ("wall_s", "round wall (s)", 1, "{:.1f}"),
    ("disconnects", "disconnects (client)", 1, "{:.0f}"),
    ("server_aborted", "aborted (server delta)", 1, "{:.0f}"),
    ("server_finished", "finished (server delta)", 1, "{:.0f}"),
    ("lost_or_corrupted", "lost / corrupted", 1, "{:.0f}"),
    ("finished_early", "leavers finished early", 1, "{:.0f}"),
    ("text_mismatches", "text mismatches vs first round", 1, "{:.0f}"),
    ("failed", "failed rounds", 1, "{:.0f}"),
)


ROUND_LINE = {"ttft_p50_s", "ttft_p99_s", "silence_p99_s", "mid_silence_p99_s", "step_server_mean_s",
              "metrics_latency_p99_s", "tokens_per_s_server", "wall_s", "disconnects", "server_aborted",
              "lost_or_corrupted"}


def fmt(value, scale: float, spec: str) -> str:
    return "-" if value is None else spec.format(value * scale)


def median_of(rounds: list[dict], key: str):
    if key == "failed":
        return sum(r.get("failed", 0) for r in rounds)
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def print_table(columns: dict[str, list[dict]]) -> None:
    names = list(columns)
    width = max(len(r[1]) for r in ROWS)
    header = f"{'metric':<{width}}" + "".join(f"  {n:>18}" for n in names)
    print(header + "\n" + "-" * len(header))
    for key, label, scale, spec in ROWS:
        print(f"{label:<{width}}" + "".join(f"  {fmt(median_of(columns[n], key), scale, spec):>18}" for n in names))


# ---------------------------------------------------------------- main

def client_record(c: ClientResult) -> dict:
    return {**asdict(c), "longest_silence_s": longest_silence(c), "lost": is_lost(c)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--compare-ref", default=None, help="also run the server code of this git ref")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-timeout", type=float, default=300.0, help="global deadline of one round's load (s)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    ap.add_argument("--server-args", default="", help="more `kiln serve` flags for every system, e.g. "
                                                        "'--max-batched-tokens 256'")
    args = ap.parse_args()
    artifact = args.artifact.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="kiln-serving-load-"))  # neutral cwd: no kiln/ folder in it

    systems = [System("current", REPO, build_shim(REPO), describe_tree(REPO))]
    if args.compare_ref:
        tree = ref_worktree(args.compare_ref)
        systems.append(System(f"ref {args.compare_ref}", tree, build_shim(tree), describe_tree(tree)))
    for s in systems:
        print(f"{s.name}: {s.root} at {s.describe}; imports {verify_code(s, run_dir)}", flush=True)

    specs = make_workload(args.streams, args.seed)
    print(f"workload: {len(specs)} streams, prompts {min(s.prompt_words for s in specs)}-"
          f"{max(s.prompt_words for s in specs)} words, {sum(s.disconnect_after is not None for s in specs)} "
          f"disconnecting; {args.rounds} round(s) per system, alternating", flush=True)

    summaries: dict[str, list[dict]] = {s.name: [] for s in systems}
    raw_rounds = []
    reference_texts = None
    for r in range(args.rounds):
        for s in systems:  # A, B, A, B: host noise lands on both systems alike
            log_path = args.out / f"serving_load_{s.name.replace(' ', '_')}_r{r + 1}.log"
            try:
                raw = run_round(s, artifact, specs, args.round_timeout, log_path, run_dir,
                                tuple(shlex.split(args.server_args)))
            except (RuntimeError, httpx.HTTPError) as err:
                # a tree under rewrite may not serve at all: record the round as failed and go on
                last = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
                print(f"[{s.name} r{r + 1}] FAILED: {type(err).__name__}: {str(err).splitlines()[0]}; server log "
                      f"{log_path} ends: {last[0][:300] if last else '(empty)'}", flush=True)
                summaries[s.name].append({"failed": 1})
                raw_rounds.append({"system": s.name, "round": r + 1, "failed": f"{type(err).__name__}: {err}",
                                   "server_log": str(log_path)})
                continue
            if reference_texts is None:
                reference_texts = {c.index: c.text for c in raw["clients"] if c.disconnect_after is None and c.done}
            summary = summarize(raw, reference_texts)
            summaries[s.name].append(summary)
            raw_rounds.append({"system": s.name, "round": r + 1, "summary": summary,
                               "clients": [client_record(c) for c in raw["clients"]],
                               **{k: v for k, v in raw.items() if k != "clients"}})
            print(f"[{s.name} r{r + 1}] " + ", ".join(
                f"{label}={fmt(summary[key], scale, spec)}" for key, label, scale, spec in ROWS if key in ROUND_LINE),
                flush=True)
            for c in raw["clients"]:
                if is_lost(c):
                    print(f"    lost: client {c.index} (leaves after {c.disconnect_after}) events={len(c.events)} "
                          f"done={c.done} errors={c.errors[:2]}", flush=True)

    print()
    print_table(summaries)
    out_file = args.out / "serving_load.json"
    out_file.write_text(json.dumps({
        "argv": sys.argv, "artifact": str(artifact), "streams": args.streams, "rounds": args.rounds,
        "seed": args.seed, "round_timeout_s": args.round_timeout,
        "systems": [{"name": s.name, "root": str(s.root), "describe": s.describe} for s in systems],
        "workload": [asdict(s) for s in specs],
        "medians": {n: {k: median_of(v, k) for k in {k for r in v for k in r}} for n, v in summaries.items()},
        "rounds_raw": raw_rounds,
    }, indent=1))
    print(f"\nwrote {out_file}")
    for s in systems:
        shutil.rmtree(s.shim, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
