"""The service end to end on a Ray cluster running with TLS (``RAY_USE_TLS=1``) and Ray's
default token authentication, with self-signed certificates this test makes (issue 15).

It needs a Ray of its own (TLS is set when Ray starts), so the driver runs in a child
process with the TLS environment; Ray's authentication settings are left at their defaults."""

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def make_certificates(folder: Path) -> dict[str, str]:
    """Write a CA and a server certificate it signed (for localhost and this host's
    addresses); return the RAY_TLS_* variables that name them."""
    import ipaddress
    import socket

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5),
                 not_valid_after=now + datetime.timedelta(days=1))

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("metricsvc test CA"))
          .issuer_name(name("metricsvc test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    addresses = {"127.0.0.1"}
    try:
        addresses.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    import ray.util

    addresses.add(ray.util.get_node_ip_address())
    alt = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(addresses)]
    cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = {
        "RAY_TLS_CA_CERT": ("ca.crt", ca.public_bytes(pem)),
        "RAY_TLS_SERVER_CERT": ("server.crt", cert.public_bytes(pem)),
        "RAY_TLS_SERVER_KEY": ("server.key", key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())),
    }
    out = {}
    for var, (filename, data) in files.items():
        path = folder / filename
        path.write_bytes(data)
        out[var] = str(path)
    return out


DRIVER = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import ray
    import metricsvc
    from metricsvc.client import MetricClient
    from tests.helpers import RankActor

    root = sys.argv[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = {"name": "tls", "world_size": 2, "sinks": {"console": None, "jsonl": {}},
           "run": {"root": root, "experiment": "tls", "trial": "t"}}
    worker = metricsvc.start_metric_worker(cfg)
    ranks = [RankActor.remote("tls", r, 2) for r in range(2)]
    for step in range(3):
        ray.get([a.run.remote([("submit_metric", ({"x": float(10 * step + r)},), {})])
                 for r, a in enumerate(ranks)])
    finals = [ray.get(worker.wait_final_res.remote(s, 60)) for s in range(3)]
    health = metricsvc.stop_metric_worker(worker)
    print("RESULT " + json.dumps({"finals": finals, "tls": os.environ.get("RAY_USE_TLS"),
                                  "run_dir": health["run_dir"]}))
''')


def test_the_service_runs_end_to_end_on_a_ray_cluster_with_tls(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(make_certificates(tmp_path), RAY_USE_TLS="1", RAY_ADDRESS="local",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "runs")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["tls"] == "1"
    assert result["finals"] == [{"x": 0.5}, {"x": 10.5}, {"x": 20.5}]  # the mean of 2 ranks
    journal = Path(result["run_dir"]) / "metrics.jsonl"
    assert len(journal.read_text().splitlines()) == 3
    assert "Token authentication is enabled" in proc.stderr  # Ray's defaults, not ours
