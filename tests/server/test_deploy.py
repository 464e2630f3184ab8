"""The deployment files against the real thing: every flag the Dockerfile and the Kubernetes manifests pass is one
`jengine serve` accepts, ports and probes agree with those flags, drains fit the grace period, and every metric the
Grafana dashboard, the HPA's adapter rule and the KEDA query name is one a live server's /metrics exports, under
`jengine:` and (with `--metrics-prefix both`) `vllm:`. The same server shows the request and stats log lines."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jengine.cli import build_parser
from tests.server.conftest import Servers, ServerHandle, wait_for

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
METRIC = re.compile(r"\b(?:jengine|vllm):[a-z0-9_]+")


def _documents() -> dict[str, dict[str, Any]]:
    """Every manifest, by `Kind/name`."""
    docs = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def _serve_args(args: list[str]):
    """What `jengine serve` makes of a container's arguments (argparse exits on any flag it does not know)."""
    return build_parser().parse_args(["serve", *args])


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _check_probes_and_drain(pod: dict[str, Any], container: dict[str, Any], flags) -> None:
    ports = _container_ports(container)
    assert ports["http"] == flags.port and ports["grpc"] == flags.grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            get = container[probe]["httpGet"]
            assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == flags.port, probe
    assert "readinessProbe" in container
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    # the pod leaves the endpoints (preStop), then SIGTERM drains for up to --drain-timeout, all within the grace
    assert pod["terminationGracePeriodSeconds"] >= float(sleep[1]) + flags.drain_timeout + 5


def test_the_dockerfile_runs_jengine_serve_with_flags_it_accepts() -> None:
    text = (ROOT / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    command = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entrypoint == ["jengine", "serve"]
    flags = _serve_args(command)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    assert exposed == {flags.port, flags.grpc_port}
    assert f"localhost:{flags.port}/health" in re.search(r"HEALTHCHECK[^\n]*\n[^\n]*", text).group(0)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and "cuda:13" in text and '".[cuda13]"' in text
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for copied in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / copied).exists() and copied not in ignored, copied


def test_the_deployment_and_service_agree_with_the_cli() -> None:
    docs = _documents()
    deployment, service = docs["Deployment/jengine"], docs["Service/jengine"]
    pod = deployment["spec"]["template"]["spec"]
    container, = pod["containers"]
    flags = _serve_args(container["args"])
    _check_probes_and_drain(pod, container, flags)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= flags.tensor_parallel_size
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    ports = _container_ports(container)
    assert {p["name"]: ports[p["targetPort"]] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 50051}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == flags.port and annotations["prometheus.io/path"] == "/metrics"
    for target in (docs["HorizontalPodAutoscaler/jengine"]["spec"]["scaleTargetRef"],
                   docs["ScaledObject/jengine"]["spec"]["scaleTargetRef"]):
        assert target["name"] == deployment["metadata"]["name"] and target.get("kind", "Deployment") == "Deployment"


def test_the_leader_worker_set_spans_its_hosts() -> None:
    docs = _documents()
    template = docs["LeaderWorkerSet/jengine-llama-70b"]["spec"]["leaderWorkerTemplate"]
    leader_pod, worker_pod = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    leader, = leader_pod["containers"]
    worker, = worker_pod["containers"]
    leader_flags, worker_flags = _serve_args(leader["args"]), _serve_args(worker["args"])
    _check_probes_and_drain(leader_pod, leader, leader_flags)
    assert leader_flags.model_tag == worker_flags.model_tag
    assert leader_flags.tensor_parallel_size == worker_flags.tensor_parallel_size
    gpus = [c["resources"]["limits"]["nvidia.com/gpu"] for c in (leader, worker)]
    assert gpus[0] == gpus[1] and template["size"] * gpus[0] == leader_flags.tensor_parallel_size
    env = {e["name"]: e.get("value") for e in leader["env"]}
    assert int(env["JENGINE_COORDINATOR_PORT"]) == _container_ports(leader)["coordinator"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    service = docs["Service/jengine-llama-70b"]
    assert service["spec"]["selector"]["role"] == template["leaderTemplate"]["metadata"]["labels"]["role"]


def _referenced_metrics() -> dict[str, set[str]]:
    """Metric names each file references: every PromQL of the dashboard, the adapter rule, the KEDA query."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "jengine.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v.get("definition", "") for v in dashboard["templating"]["list"]]
    docs = _documents()
    rules = yaml.safe_load(docs["ConfigMap/prometheus-adapter-jengine"]["data"]["config.yaml"])["rules"]
    keda = docs["ScaledObject/jengine"]["spec"]["triggers"][0]["metadata"]["query"]
    return {"dashboard": {m for e in exprs for m in METRIC.findall(e)},
            "adapter": {m for r in rules for m in METRIC.findall(r["seriesQuery"])}, "keda": set(METRIC.findall(keda))}


@pytest.fixture(scope="module")
def live(chat_model_dir: Path) -> Iterator[tuple[ServerHandle, set[str]]]:
    """A server exporting both prefixes, after one finished request; and the series names its /metrics exports."""
    servers = Servers()
    handle = servers.start(chat_model_dir, server_kwargs={"metrics_prefix": "both", "log_stats_interval": 0.2})
    response = handle.client().chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 4
    handle.wait_idle()
    names = {line.split("{")[0].split(" ")[0] for line in handle.http.get("/metrics").text.splitlines()
             if line and not line.startswith("#")}
    yield handle, names
    servers.stop_all()


def test_every_metric_the_deploy_files_name_is_exported(live: tuple[ServerHandle, set[str]]) -> None:
    _, exported = live
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported} | exported
    for where, names in _referenced_metrics().items():
        assert names, where
        assert names <= families, (where, sorted(names - families))
        vllm_names = {n.replace("jengine:", "vllm:") for n in names}
        assert vllm_names <= families, (where, sorted(vllm_names - families))
    hpa = _documents()["HorizontalPodAutoscaler/jengine"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa == "jengine_num_requests_waiting"  # the adapter rule's name for jengine:num_requests_waiting


def test_the_log_has_a_line_per_request_and_periodic_stats(live: tuple[ServerHandle, set[str]],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    handle, _ = live
    with caplog.at_level(logging.INFO):
        handle.client().completions.create(model="tiny-chat", prompt="Hello there", max_tokens=3,
                                           extra_body={"ignore_eos": True})
        wait_for(lambda: "Avg generation throughput" in caplog.text, timeout=10, what="a stats line")
    finished = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished request")]
    assert len(finished) == 1 and "3 generated (length)" in finished[0]
    stats = next(r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage())
    assert re.match(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                    r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
                    r"Prefix cache hit rate: [\d.]+%$", stats), stats


def test_the_cli_takes_the_metrics_prefix_and_log_switches() -> None:
    from jengine.cli import _server_config

    args = build_parser().parse_args(["serve", "--metrics-prefix", "vllm", "--disable-log-stats",
                                      "--disable-log-requests"])
    config = _server_config(args)
    assert (config.metrics_prefix, config.log_stats_interval, config.log_requests) == ("vllm", 0.0, False)
