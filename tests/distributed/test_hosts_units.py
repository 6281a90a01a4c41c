"""The pieces of joining machines that need no cluster: the token copy, the `ray start`
command lines, addresses, and the one-line problems the cluster check reports."""

from __future__ import annotations

import stat

import pytest

from bargein.cli import main
from bargein.distributed.cluster_auth import ClusterAuth, mode_for
from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.join import (
    NodeStart,
    address_towards,
    ensure_token,
    install_token,
    local_token,
    split_address,
    token_environment,
)

connect = pytest.importorskip("bargein.distributed.connect")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_head_makes_a_token_once_and_a_copy_is_installed_private(home) -> None:
    assert local_token() is None
    token = ensure_token()
    assert len(token) == 64 and ensure_token() == token  # made once
    path = home / ".ray" / "auth_token"
    assert path.read_text() == token and stat.S_IMODE(path.stat().st_mode) == 0o600
    install_token(" other\n")
    assert local_token() == "other"
    with pytest.raises(PipelineSetupError, match="empty or has spaces"):
        install_token("two words")


def test_the_token_in_the_environment_wins(home, monkeypatch) -> None:
    install_token("from-file")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert local_token() == "from-env"
    assert token_environment({"A": "1"}) == {"A": "1", "RAY_AUTH_MODE": "token"}


def test_ray_start_command_lines() -> None:
    head = NodeStart("10.0.0.10", port=6380, temp_dir="/t", num_cpus=0, memory_bytes=300, object_store_bytes=80)
    assert head.command("ray") == ["ray", "start", "--node-ip-address", "10.0.0.10", "--disable-usage-stats",
                                   "--head", "--port", "6380", "--include-dashboard=false", "--temp-dir", "/t",
                                   "--num-cpus", "0", "--memory", "300", "--object-store-memory", "80"]
    worker = NodeStart("10.0.0.11", head_address="10.0.0.10:6380")
    assert worker.command("ray") == ["ray", "start", "--node-ip-address", "10.0.0.11", "--disable-usage-stats",
                                     "--address", "10.0.0.10:6380"]


def test_addresses() -> None:
    assert split_address("10.0.0.1") == ("10.0.0.1", 6379) and split_address("h:7000") == ("h", 7000)
    with pytest.raises(PipelineSetupError, match="bad Ray address 'h:x'"):
        split_address("h:x")
    assert address_towards("127.0.0.1") == "127.0.0.1"


def test_each_version_difference_is_one_line() -> None:
    head = connect.NodeFacts("2.60.0", "3.11.9", "0.1.0")
    assert connect.version_problems("10.0.0.12", connect.NodeFacts("2.60.0", "3.11.2", "0.1.0"), head) == []
    lines = connect.version_problems("10.0.0.12", connect.NodeFacts("2.59.1", "3.12.1", "0.0.9"), head)
    assert [line.split(":")[0] for line in lines] == [
        "node 10.0.0.12 runs Ray 2.59.1, the head 2.60.0", "node 10.0.0.12 runs Python 3.12.1, the head 3.11.9",
        "node 10.0.0.12 has bargein 0.0.9, the head 0.1.0"]
    problems = connect.ClusterProblems(lines[:2])
    assert str(problems).splitlines()[0] == "the Ray cluster is not ready:" and len(str(problems).splitlines()) == 3


def test_the_no_token_messages_say_what_to_copy(home, monkeypatch) -> None:
    assert "this machine has none: copy the head's ~/.ray/auth_token here" in connect.no_token_message("h:6379")
    install_token("x")
    assert "refused this machine's token" in connect.no_token_message("h:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "asks for a token and RAY_AUTH_MODE=disabled here: unset RAY_AUTH_MODE" in connect.no_token_message("h:1")


def test_the_head_joins_with_the_cluster_s_auth_mode_not_the_token_file_s() -> None:
    """A token held here does not turn tokens on for a cluster that answered without one
    (its calls back to the head would be refused); a cluster that asks for one gets it, or
    a clear error; where the cluster did not say, a token held here is presented."""
    for has_token in (True, False):
        assert mode_for(ClusterAuth.NONE, "h:1", has_token=has_token) == "disabled"
    assert mode_for(ClusterAuth.TOKEN, "h:1", has_token=True) == "token"
    with pytest.raises(PipelineSetupError) as refused:
        mode_for(ClusterAuth.TOKEN, "h:1", has_token=False)
    assert str(refused.value) == ("the Ray cluster at h:1 uses token authentication and this machine holds no "
                                  "token: copy the head's ~/.ray/auth_token here (`bargein cluster join HEAD "
                                  "--token-file FILE` does it) or set RAY_AUTH_TOKEN")
    assert mode_for(ClusterAuth.UNKNOWN, "h:1", has_token=True) == "token"
    assert mode_for(ClusterAuth.UNKNOWN, "h:1", has_token=False) is None


def test_join_without_a_token_or_with_a_bad_file_stops_before_ray(home, capsys) -> None:
    assert main(["cluster", "join", "127.0.0.1:1"]) == 1
    assert "no token: copy the head's ~/.ray/auth_token" in capsys.readouterr().err
    assert main(["cluster", "join", "127.0.0.1:1", "--token-file", str(home / "missing")]) == 2
    assert "--token-file" in capsys.readouterr().err
    install_token("x")
    assert main(["cluster", "join", "127.0.0.1:1"]) == 1  # nothing listens there
    assert "no Ray head answers at 127.0.0.1:1 from this machine" in capsys.readouterr().err


def test_a_node_that_left_the_cluster_joins_again_once_the_head_answers(tmp_path) -> None:
    """``bargein cluster join --rejoin``'s watch (distributed/rejoin.py) with stand-ins: a
    "raylet" is a sleeping process with a raylet's command line, the head a listening
    socket, ``ray start`` a function that starts a stand-in raylet. The first raylet ends
    (Ray declared the node dead) while the head does not answer: the watch says so once,
    waits, and starts the node again as soon as the head answers."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    from bargein.distributed.rejoin import keep_joined, raylets, start_node

    raylet = tmp_path / "bin" / "raylet"
    raylet.parent.mkdir()
    raylet.symlink_to(sys.executable)
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    port = head.getsockname()[1]
    start = NodeStart("127.0.0.77", head_address=f"127.0.0.1:{port}", temp_dir=str(tmp_path / "ray"))
    started: list[subprocess.Popen] = []

    def ray_start(s: NodeStart) -> None:
        assert s == start  # the same node again: address, CPUs, memory, temp dir
        started.append(subprocess.Popen([str(raylet), "-c", "import time; time.sleep(60)",
                                         f"--node_ip_address={s.node_ip}", f"--temp_dir={s.temp_dir}"]))

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    lines: list[str] = []
    stop = threading.Event()
    try:
        watched = start_node(start, ray_start)
        assert {p.pid for p in watched} == {started[0].pid}
        assert raylets("127.0.0.78") == set()  # another node's address: not ours
        watch = threading.Thread(target=keep_joined, args=(start, ray_start, lines.append, watched, stop),
                                 kwargs={"poll_s": 0.02, "retry_s": 0.05})
        watch.start()
        started[0].kill()  # the node is declared dead; the head is unreachable for now
        wait_for(lambda: any(line.startswith("not yet: no Ray head answers") for line in lines), "no retry said")
        time.sleep(0.3)  # tries meanwhile are not said again, and start nothing
        assert len(started) == 1 and sum(line.startswith("not yet") for line in lines) == 1
        head.listen()  # the head answers again
        wait_for(lambda: len(started) == 2 and any("again" in line for line in lines[-1:]), "no rejoin")
        assert lines[0].startswith("this node left the Ray cluster (its raylet ended: Ray declared the node dead")
        assert lines[-1] == f"this machine (127.0.0.77) joined the Ray cluster at 127.0.0.1:{port} again"
        time.sleep(0.2)  # the new raylet lives: nothing more happens
        assert len(started) == 2 and started[1].poll() is None
    finally:
        stop.set()
        for p in started:
            p.kill()
            p.wait()
        head.close()
