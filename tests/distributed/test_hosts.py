"""Several machines as the README sets them up, on three network-namespace hosts
(tests/net_hosts.py): a Ray head on h0 started with ``bargein cluster start``, h1 and h2
joined with ``bargein cluster join`` after the head's token is copied to them (each host
has its own HOME, so the copy is what lets them in; h2's join runs on with ``--rejoin``),
then ``bargein serve`` on h0 with a 2-stage pipeline over h1 and h2, and a second server
with 2 replicas there. The test
process talks to the servers at h0's address only.

Shown: the join refuses without the token and the cluster check finds every node; the
pipeline across hosts answers token for token as one process does, each stage with the
threads its host offers; a cancel by id stops every stage; a follow-up turn is served
from the cache; a host made slow (a cgroup CPU quota) is measured so, gets fewer layers
than its memory alone would give it and a smaller routing weight; the replicas run with
the threads their host offers and the server's wait policy, weighed by their hosts'
measured speed; 16 concurrent chats that share a system prompt are balanced over the
replicas while each conversation's turns stay on their replica; a host whose link goes
down mid-answer costs that answer a pause (it resumes, token for token, on the other
replica, which keeps serving), and when the link stays down until Ray declares the host
dead, h2's ``bargein cluster join --rejoin`` brings it back into the cluster by itself; a
host that loses every process (h2) costs a pause, not the answers.

One set of hosts and one Ray cluster for the module (about two minutes on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bargein.distributed.cluster_auth import ClusterAuth, probe
from bargein.distributed.split import speed_factors
from bargein.kernels.native import cache_dir
from tests import cpu_limits
from tests.net_hosts import Host, Hosts, make_hosts, remove_hosts, skip_or_fail, unavailable
from tests.ray_starts import one_at_a_time
from tests.started import count
from tests.tiny_models import SPECIAL_TOKENS, TinySpec, tiny_tokenizer, tiny_weights, write_gguf

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SPEC = TinySpec(num_layers=6)
PORT, REPLICA_PORT = 8000, 8001
NO_CONTROL = {str(tiny_tokenizer().token_to_id(t)): -100 for t in SPECIAL_TOKENS}
GREEDY = {"temperature": 0, "ignore_eos": True, "logit_bias": NO_CONTROL, "return_token_ids": True}
SYSTEM = {"role": "system", "content": "You are a careful assistant; answer briefly."}  # the tiny model holds 256
# Each host's Ray node: CPUs (logical: this machine's cores are shared by all; four times
# as many as there are, so that on h1 a pipeline stage and a replica, each taking what its
# host offers (every core), fit beside h2's replica and stage when they are re-created
# there) and memory, which the layer split reads (h1 gets more layers than h2). The head
# offers no CPU: stages and replicas go to h1 and h2.
CORES = len(os.sched_getaffinity(0))
NODE_FLAGS = {0: ("--num-cpus", "0", "--memory", "300MiB"),
              1: ("--num-cpus", str(4 * CORES), "--memory", "600MiB"),
              2: ("--num-cpus", str(4 * CORES), "--memory", "300MiB")}
# How soon the head declares an unreachable node dead (Ray's health checks, read by its GCS
# from the environment): 4 checks of 1.5 s unanswered, about 10 s, not Ray's minute, so the
# link test's host is declared dead while its link is down. A raylet would have to stall 6 s
# to be declared dead wrongly.
FAST_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1500",
              "RAY_health_check_failure_threshold": "4"}


@dataclass
class Cluster:
    hosts: Hosts
    model: str  # the model's path on every host that has it: ~/models/tiny.gguf
    local_model: Path  # h0's copy, which this process reads for the reference
    rejoin_log: Path  # what `bargein cluster join --rejoin` on h2 says

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:6379"


def _ok(done, what: str) -> str:
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _join(host: Host, address: str, token_copy: Path, flags: tuple[str, ...]) -> str:
    with one_at_a_time():  # not beside another Ray instance's start (tests/ray_starts.py)
        return _ok(host.bargein("cluster", "join", address, "--token-file", str(token_copy), "--temp-dir",
                                str(host.temp_dir), "--object-store-memory", "80MiB", *flags), f"join on {host.name}")


def _join_and_rejoin(host: Host, address: str, token_copy: Path, flags: tuple[str, ...]) -> Path:
    """``bargein cluster join --rejoin`` on ``host``, left running (its log returned) once joined."""
    log = host.home / "rejoin.log"
    with one_at_a_time():  # not beside another Ray instance's start (tests/ray_starts.py)
        return _start_rejoin(host, address, token_copy, flags, log)


def _start_rejoin(host: Host, address: str, token_copy: Path, flags: tuple[str, ...], log: Path) -> Path:
    watcher = host.popen([sys.executable, "-m", "bargein.cli", "cluster", "join", address, "--token-file",
                          str(token_copy), "--temp-dir", str(host.temp_dir), "--object-store-memory", "80MiB",
                          *flags, "--rejoin"], log)
    deadline = time.monotonic() + 120
    while "watching this node" not in log.read_text():
        assert watcher.poll() is None, f"join --rejoin on {host.name} ended:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"join --rejoin on {host.name}: not joined in 120 s"
        time.sleep(0.1)
    return log


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = unavailable()
    if why:
        skip_or_fail(why)
    # Not under pytest's temp dir: an xdist worker's is deeper, and Ray's socket paths in a
    # host's temp dir would pass the 107 bytes AF_UNIX allows.
    root = Path(tempfile.mkdtemp(prefix="bargein-hosts-"))
    hosts = make_hosts(3, root)
    count("Ray clusters")
    count("Ray nodes", 3)
    try:
        # The kernels this process built, shared: each host compiling its own takes minutes on 2 cores.
        kernels = str(cache_dir().parent)
        for host in hosts.hosts:
            host.env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RAY_USAGE_STATS_ENABLED": "0",
                        "BARGEIN_CACHE_DIR": kernels}
        weights = tiny_weights(SPEC)
        for host in hosts.hosts[:2]:  # h2 has no copy: its stage's weights are shipped
            (host.home / "models").mkdir()
            write_gguf(host.home / "models" / "tiny.gguf", SPEC, weights, tensor_type="Q8_0")
        head = hosts[0]
        head.env |= FAST_DEATH  # for the head's processes (its GCS), and the servers there (no effect)
        with one_at_a_time():
            started = _ok(head.bargein("cluster", "start", "--node-ip", head.ip, "--temp-dir", str(head.temp_dir),
                                       "--object-store-memory", "80MiB", *NODE_FLAGS[0]), "cluster start")
        assert f"bargein cluster join {head.ip}:6379 --token-file COPY" in started
        address = f"{head.ip}:6379"
        refused = hosts[1].bargein("cluster", "join", address)  # no token copied yet
        assert refused.returncode == 1 and "no token: copy the head's ~/.ray/auth_token" in refused.stderr
        token_copy = root / "token-copy"  # what a user's scp does
        shutil.copy(head.home / ".ray" / "auth_token", token_copy)
        assert f"({hosts[1].ip}) joined the Ray cluster at {address}" in _join(hosts[1], address, token_copy,
                                                                              NODE_FLAGS[1])
        rejoin_log = _join_and_rejoin(hosts[2], address, token_copy, NODE_FLAGS[2])  # h2 watches its node
        assert f"({hosts[2].ip}) joined the Ray cluster at {address}" in rejoin_log.read_text()
        yield Cluster(hosts, "~/models/tiny.gguf", hosts[0].home / "models" / "tiny.gguf", rejoin_log)
    finally:
        remove_hosts(hosts)
        shutil.rmtree(root, ignore_errors=True)


class Server:
    """``bargein serve`` on the head host, reached at the head's address."""

    def __init__(self, cluster: Cluster, port: int, *flags: str, env: tuple[str, ...] = ()):
        self.url = f"http://{cluster.head.ip}:{port}"
        self.log = cluster.head.home / f"serve-{port}.log"
        self.proc = cluster.head.popen([
            "env", *env, sys.executable, "-m", "bargein.cli", "serve", "--model", cluster.model, "--ray", cluster.address,
            "--host", cluster.head.ip, "--port", str(port), "--kv-tokens", "2048", "--debug-endpoints", *flags],
            self.log)
        count("bargein servers")

    def wait_ready(self, timeout: float = 240) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited:\n{self.log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"serve not ready in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()

    def chat(self, messages: list[dict], max_tokens: int = 16, **headers: str) -> dict:
        r = httpx.post(f"{self.url}/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, **GREEDY})
        assert r.status_code == 200, r.text
        return r.json()

    def cluster(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster", timeout=30).json()


@pytest.fixture(scope="module")
def pipeline(cluster: Cluster) -> Iterator[Server]:
    server = Server(cluster, PORT, "--pipeline-stages", "2")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(cluster: Cluster):
    from bargein import Engine
    from bargein.config import EngineConfig

    return Engine.from_pretrained(str(cluster.local_model), EngineConfig())


def _expected(reference, prompt_ids: list[int], n: int) -> list[int]:
    from bargein import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                            logit_bias={int(k): v for k, v in NO_CONTROL.items()})
    return list(reference.generate([prompt_ids], params)[0].token_ids)


def test_the_cluster_check_finds_every_host(cluster: Cluster) -> None:
    out = _ok(cluster.head.bargein("cluster", "check", "--ray", cluster.address), "cluster check")
    assert "the Ray cluster is ready: 3 nodes" in out
    assert all(h.ip in out for h in cluster.hosts.hosts)
    # A bargein cluster asks for a token: a call without one is refused (what a head joining
    # it finds out first, bargein/distributed/cluster_auth.py).
    assert probe(cluster.address) is ClusterAuth.TOKEN


def test_the_pipeline_spans_the_hosts_and_answers_as_one_process(cluster: Cluster, pipeline: Server,
                                                                   reference) -> None:
    info = pipeline.cluster()
    assert [s["node_address"] for s in info["stages"]] == [cluster.hosts[1].ip, cluster.hosts[2].ip]
    assert info["stages"][0]["layers"][1] - info["stages"][0]["layers"][0] >= 3  # h1 offers more memory
    assert info["stages"][1]["weights_from"] != "file"  # h2 has no copy: shipped by the head
    # Distinct hosts: their speed was measured for the split (on this shared machine they
    # are alike, so memory decides), and the reason names each host.
    assert info["split"].startswith("by memory and measured speed: ")
    assert f"{cluster.hosts[1].ip} 600 MiB" in info["split"] and f"{cluster.hosts[2].ip} 300 MiB" in info["split"]
    # No --threads: each stage has what its host offers (the CPUs its processes may use, fewer than
    # Ray's), and its host was measured with them; each host's rate is cached in its own home.
    assert [s["threads"] for s in info["stages"]] == [CORES, CORES]
    assert info["wait_policy"] == "GOMP_SPINCOUNT=100"  # bargein's own, as the head runs with it
    for host in cluster.hosts.hosts[1:]:
        (entry,) = [json.loads(p.read_text()) for p in (host.home / ".cache/bargein/calibration").glob("*.json")]
        assert entry["address"] == host.ip and entry["layers_per_s"] > 0 and entry["threads"] == CORES
    body = pipeline.chat([{"role": "user", "content": "Tell me about the sea, please."}], max_tokens=24)
    (choice,) = body["choices"]
    assert choice["token_ids"] == _expected(reference, choice["prompt_token_ids"], 24)


def test_a_cancel_by_id_stops_every_stage(pipeline: Server) -> None:
    def stream() -> list[str]:
        with httpx.stream("POST", f"{pipeline.url}/v1/chat/completions", timeout=120,
                          headers={"X-Request-Id": "stop-me"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}],
                                "max_tokens": 2000, "stream": True, **GREEDY, "return_token_ids": False}) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lines = pool.submit(stream)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # cancel once it is generating
            live = httpx.get(f"{pipeline.url}/v1/requests", timeout=10).json()["data"]
            if any(r["id"] == "stop-me" and r["completion_tokens"] >= 3 for r in live):
                break
            time.sleep(0.05)
        r = httpx.post(f"{pipeline.url}/v1/requests/stop-me/cancel", timeout=10)
        assert r.json()["status"] == "cancelled", r.text
        events = lines.result(timeout=60)
    assert '"finish_reason":"cancelled"' in "".join(events).replace(" ", "")
    plans = [s["plans"] for s in pipeline.cluster()["stages"]]
    time.sleep(1.0)  # a stage still computing the cancelled answer would count more plans
    assert [s["plans"] for s in pipeline.cluster()["stages"]] == plans
    assert plans[0] == plans[1]  # every plan went through both stages, none after the cancel


def test_a_follow_up_turn_is_served_from_the_cache(pipeline: Server) -> None:
    first_turn = [SYSTEM, {"role": "user", "content": "What is a lighthouse for?"}]
    first = pipeline.chat(first_turn, max_tokens=20)
    (choice,) = first["choices"]
    history = first_turn + [{"role": "assistant", "content": choice["message"]["content"]},
                            {"role": "user", "content": "And at night?"}]
    second = pipeline.chat(history)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1


def test_a_slow_host_gets_fewer_layers_than_its_memory_would_give_it(cluster: Cluster) -> None:
    """h1 (600 MiB, twice h2's memory) is made slow with a cgroup CPU quota of 0.15 CPU; h2
    gets the largest CPU weight, so that it measures a whole core however loaded this
    machine is. The split a 2-stage server would use (tests/distributed/split_probe.py, on
    h0, every node measured afresh) gives h1 fewer layers than memory alone does (4 of 6),
    and says why; the rates are then cached on each host."""
    why = cpu_limits.unavailable()
    if why:  # a container may hold the cpu controller back even from root: not required under CI
        pytest.skip(why)
    slow, fast = cluster.hosts[1], cluster.hosts[2]
    with cpu_limits.cpu_group(slow.pids(), cpus=0.15), cpu_limits.cpu_group(fast.pids(), weight_max=True):
        done = cluster.head.run([sys.executable, "-m", "tests.distributed.split_probe", cluster.address,
                                 cluster.model], timeout=240)
    probe = json.loads(_ok(done, "split probe").strip().splitlines()[-1])
    # The router weighs replicas on these hosts by the same rates: of 16 new chats at once,
    # the slow host's replica gets fewer than half (tests/distributed/test_calibrated_routing.py
    # has the exact shares).
    assert probe["routing_weights"][0] < 0.5 and probe["routing_weights"][1] == 1.0, probe
    assert probe["routed"][0] < probe["routed"][1] and sum(probe["routed"]) == 16
    assert probe["addresses"] == [slow.ip, fast.ip]
    assert probe["memory_only"] == [[0, 4], [4, 6]]
    assert probe["layers"][0][1] < 4, probe["reason"]  # the slow host: fewer layers than memory gives it
    factors = {part.split()[0]: float(part.rsplit("x", 1)[1]) for part in probe["reason"].split(": ", 1)[1].split(", ")}
    assert factors[slow.ip] < 0.5 and factors[fast.ip] == 1.0, probe["reason"]
    assert probe["cached"] == {slow.ip: True, fast.ip: True}


@pytest.fixture(scope="module")
def replicas_starting(cluster: Cluster, pipeline: Server) -> Iterator[Server]:
    """The replica server, started (not yet ready): the forced-graph test runs while it loads."""
    # No --threads: each replica gets what its host offers, a thread per core (the CPUs its
    # processes may use; Ray declares two more), and takes as many Ray CPUs (one replica per
    # host: the pipeline's stages hold one on each). A wait policy of the server's own, unlike the
    # nodes' (set by bargein cluster join), shows that the server hands its own to the replicas.
    server = Server(cluster, REPLICA_PORT, "--replicas", "2", env=("GOMP_SPINCOUNT=250",))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def replicas(replicas_starting: Server) -> Server:
    return replicas_starting.wait_ready()


def _routed(server: Server) -> list[int]:
    return [r["routed"] for r in server.cluster()["replicas"]]


def test_a_forced_graph_transport_across_hosts_is_refused_before_loading(cluster: Cluster,
                                                                    replicas_starting: Server) -> None:
    """Refused after connecting and placing (the hosts' rates are cached by then: the
    pipeline's start measured them), before any stage loads; run while the replica server
    starts, so that the two processes' starts overlap."""
    done = cluster.head.bargein("serve", "--model", cluster.model, "--ray", cluster.address, "--port", "0",
                                "--kv-tokens", "512", "--pipeline-stages", "2", "--pipeline-transport", "graph")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "bargein: error: the graph transport needs every pipeline stage on the head's node; use "
        "--pipeline-transport auto or calls across nodes")
    assert "pipeline of 2 stages" not in done.stderr  # refused before any stage loaded


def test_replicas_sit_on_both_hosts_and_show_their_addresses(cluster: Cluster, replicas: Server) -> None:
    info = replicas.cluster()
    assert sorted(r["node_address"] for r in info["replicas"]) == sorted(h.ip for h in cluster.hosts.hosts[1:])
    # Each replica has what its host offers: the CPUs its processes may use (fewer than Ray's).
    assert [(r["threads"], r["wait_policy"]) for r in info["replicas"]] == [(CORES, "GOMP_SPINCOUNT=250")] * 2
    # Each replica's host was measured (its calibration, with its threads) and the router weighs
    # each by its share of the fastest (hosts within half of each other's speed weigh the same:
    # these share one machine's cores, and one measured slow is measured again).
    rates = [r["layers_per_s"] for r in info["replicas"]]
    assert all(rate > 0 for rate in rates), info["replicas"]
    # (the router weighs by the measured rates, the snapshot shows them rounded to 0.1: the
    # factors recomputed here can differ from its rounded ones in the fourth decimal)
    assert [r["speed"] for r in info["replicas"]] == pytest.approx(speed_factors(rates), abs=1e-3)
    assert "compute threads per replica: what its node offers" in replicas.log.read_text()
    # Ray's "the actor restart will fail" error, which a replica's builder (the shipped
    # model: an object reference) once caused at every start, is not logged.
    assert "core_worker" not in replicas.log.read_text()


def test_chats_sharing_a_system_prompt_are_balanced_and_turns_stay_on_their_replica(replicas: Server) -> None:
    before = _routed(replicas)
    chats = [[SYSTEM, {"role": "user", "content": f"Question {n}: the sky at {n} pm?"}] for n in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        firsts = list(pool.map(lambda m: replicas.chat(m, max_tokens=12), chats))
    counts = [a - b for a, b in zip(_routed(replicas), before, strict=True)]
    assert sum(counts) == 16 and max(counts) <= 1.5 * 16 / 2, counts
    for n in (0, 1, 2):  # each turn of one conversation lands where its first turn was answered
        history = chats[n] + [{"role": "assistant", "content": firsts[n]["choices"][0]["message"]["content"]}]
        third = None
        for turn in ("Why?", "Are you sure?"):
            history = history + [{"role": "user", "content": turn}]
            routed = _routed(replicas)
            body = replicas.chat(history, max_tokens=8)
            moved = [a - b for a, b in zip(_routed(replicas), routed, strict=True)]
            assert sorted(moved) == [0, 1]
            assert third is None or moved == third, "a turn changed replica"
            third = moved
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            history = history + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]


def _stream_chat(server: Server, messages: list[dict], max_tokens: int, first: threading.Event) -> dict:
    """A streamed greedy chat; sets ``first`` at its first content; returns the final choice
    (with its token ids) and when it ended."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=180,
                      json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": True,
                            **GREEDY}) as r:
        assert r.status_code == 200, r.read()
        final = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", ()):
                if choice["delta"].get("content"):
                    first.set()
                if choice.get("finish_reason"):
                    final = choice
    assert final is not None, "the stream ended without a final chunk"
    return final | {"ended": time.monotonic()}


def _new_chats_to_reach_every_replica(speeds: list[float]) -> list[int]:
    """The replicas that new chats started at once go to, by the router's least-queue rule
    (a replica's live requests plus one, over its routing weight), until every replica has one."""
    loads = [0] * len(speeds)
    spread = []
    while min(loads) == 0:
        chosen = min(range(len(speeds)), key=lambda i: ((loads[i] + 1) / speeds[i], i))
        loads[chosen] += 1
        spread.append(chosen)
    return spread


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.2)


def test_a_host_whose_link_stays_down_past_its_death_costs_a_pause_and_rejoins(cluster: Cluster, replicas: Server,
                                                                                reference) -> None:
    """Answers are generating on both hosts' replicas when h2's cable is pulled (its veth
    down): those on h1 go on; those on h2 pause until the head finds the replica lost and
    resume on h1 from the tokens delivered, token for token; a new chat is served
    meanwhile. As many answers start at once as the router needs to give each replica one
    (two, unless this shared machine measured one host under half the other's speed). The link stays down until Ray has declared h2 dead (Ray restarts
    its replica on h1), so that when it comes back h2's raylet ends and Ray would never
    take that node back: ``bargein cluster join --rejoin`` on h2 starts the node again, by
    itself, and the cluster check runs a task on it."""
    lost, answer = cluster.hosts[2], 230
    on_lost = next(r["index"] for r in replicas.cluster()["replicas"] if r["node_address"] == lost.ip)
    before = replicas.cluster()
    speeds = [r["speed"] for r in before["replicas"]]
    spread = _new_chats_to_reach_every_replica(speeds)
    assert len(spread) <= 12, f"routing weights {speeds}: the hosts' measured speeds are absurd"
    # Each opens with its own number, so that no two share a cached block the router would follow.
    chats = [[{"role": "user", "content": f"{n}. Tell a long story."}] for n in range(len(spread))]
    # Pulled at the first streamed content of any: the answers on h2 (a tiny model's 230
    # tokens take a fraction of a second) must not be over yet.
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        answers = [pool.submit(_stream_chat, replicas, m, answer, started) for m in chats]
        assert started.wait(60), "the answers did not start"
        lost.link(up=False)
        try:
            down_at = time.monotonic()
            finals = [a.result(timeout=120) for a in answers]
            # Meanwhile the other replica serves a new chat, token for token.
            body = replicas.chat([{"role": "user", "content": "Are you still there?"}], max_tokens=8)
            (choice,) = body["choices"]
            assert choice["token_ids"] == _expected(reference, choice["prompt_token_ids"], 8)
            after = replicas.cluster()
            # Ray restarts the lost replica only once it has declared its node dead: then on h1.
            _wait_for(lambda: all(r["up"] for r in replicas.cluster()["replicas"]), 120, "the replica restarted")
            assert replicas.cluster()["replicas"][on_lost]["node_address"] == cluster.hosts[1].ip
        finally:
            lost.link(up=True)
    routed = [a["routed"] - b["routed"] for a, b in zip(after["replicas"], before["replicas"], strict=True)]
    on_h2 = routed[on_lost]
    # Answers started on each host; h2's were routed again, to h1, when resumed; and the new chat.
    assert on_h2 >= 1 and sum(routed) == len(chats) + on_h2 + 1, (routed, speeds)
    for final in finals:
        assert final["finish_reason"] == "length"
        assert final["token_ids"] == _expected(reference, final["prompt_token_ids"], answer)
    assert after["replicas"][on_lost]["lost"] == before["replicas"][on_lost]["lost"] + 1
    assert after["resubmitted"] == before["resubmitted"] + on_h2  # the answers on h2, resumed on h1
    assert max(f["ended"] for f in finals) - down_at >= 2  # that one waited for the loss to be found
    # The link is back: h2's old node ends, and the watch on h2 starts it again.
    again = f"this machine ({lost.ip}) joined the Ray cluster at {cluster.address} again"
    _wait_for(lambda: again in cluster.rejoin_log.read_text(), 120, "h2 joined again")
    assert "this node left the Ray cluster" in cluster.rejoin_log.read_text()
    out = _ok(cluster.head.bargein("cluster", "check", "--ray", cluster.address), "cluster check")
    assert "the Ray cluster is ready: 3 nodes" in out and lost.ip in out  # a task ran on h2's new node
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda n: replicas.chat([{"role": "user", "content": f"Again {n}?"}], max_tokens=8),
                               range(4)))
    for body in bodies:
        (choice,) = body["choices"]
        assert choice["token_ids"] == _expected(reference, choice["prompt_token_ids"], 8)


def test_a_host_that_loses_every_process_costs_a_pause_not_the_answers(cluster: Cluster, pipeline: Server,
                                                                       reference) -> None:
    lost = cluster.hosts[2]
    lost.kill_all()
    body = pipeline.chat([{"role": "user", "content": "Still there?"}], max_tokens=16)
    (choice,) = body["choices"]
    assert choice["token_ids"] == _expected(reference, choice["prompt_token_ids"], 16)
    info = pipeline.cluster()
    assert info["recovery"]["recoveries"] >= 1
    assert {s["node_address"] for s in info["stages"]} == {cluster.hosts[1].ip}
