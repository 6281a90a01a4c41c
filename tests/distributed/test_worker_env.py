"""What the head hands its Ray workers (distributed/worker_env.py), and how ``serve``'s
``--threads`` becomes each replica's threads (checked before anything starts), without Ray."""

from __future__ import annotations

from bargein.distributed.worker_env import describe_wait_policy, wait_policy_env, worker_runtime_env


def test_the_wait_policy_the_head_runs_with_goes_to_its_workers(monkeypatch) -> None:
    assert wait_policy_env({"GOMP_SPINCOUNT": "100", "PATH": "/bin"}) == {"GOMP_SPINCOUNT": "100"}
    assert wait_policy_env({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "7"}) == {
        "GOMP_SPINCOUNT": "7", "OMP_WAIT_POLICY": "passive"}
    assert describe_wait_policy({"GOMP_SPINCOUNT": "250"}) == "GOMP_SPINCOUNT=250"
    assert describe_wait_policy({}) == "OpenMP default"
    monkeypatch.setenv("GOMP_SPINCOUNT", "100")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_runtime_env() == {"runtime_env": {"env_vars": {"GOMP_SPINCOUNT": "100"}}}
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert worker_runtime_env() == {}  # nothing set: the actors start as Ray starts them


def test_serve_refuses_replica_threads_under_one_before_starting(capsys) -> None:
    from bargein.cli import main

    assert main(["serve", "--port", "0", "--ray", "local", "--replicas", "2", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "bargein: error: --threads must be at least 1, got 0"


def test_serve_threads_become_each_replicas_threads_and_cpus(tmp_path, monkeypatch, capsys) -> None:
    import bargein.build
    from bargein.cli.model import launch_replicas
    from bargein.config import EngineConfig
    from tests.tiny_models import TinySpec, tiny_weights, write_gguf

    model = tmp_path / "tiny.gguf"
    write_gguf(model, TinySpec(), tiny_weights(TinySpec()), tensor_type="Q8_0")
    given = []
    monkeypatch.setattr(bargein.build, "build_replicas", lambda ref, config, address, n, options: given.append(options))
    launch_replicas(str(model), EngineConfig(), "local", 2, threads=3)
    assert "3 compute threads per replica (--threads)" in capsys.readouterr().err
    launch_replicas(str(model), EngineConfig(), "local", 2)
    assert "compute threads per replica: what its node offers" in capsys.readouterr().err
    assert [(o.threads, o.num_cpus) for o in given] == [(3, 3), (None, 1)]  # None: per node (replicas/slots.py)
