"""`pagellm serve --ssl-keyfile --ssl-certfile`: HTTPS through uvicorn, with a self-signed certificate made
for the test; the openai client trusts it through its httpx client."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pagellm.entrypoints.openai.launch import free_port
from tests.entrypoints.openai.server_utils import RemoteServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for 127.0.0.1 (the openssl command)."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(llama_path, tls):
    key, cert = tls
    srv = RemoteServer(llama_path, ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--max-model-len", "128"],
                       verify=str(cert))
    yield srv
    assert srv.stop() == 0


def test_the_openai_client_talks_https_to_the_server(server, tls):
    _, cert = tls
    assert server.url.startswith("https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=cert)) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http)
        out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert out.usage.completion_tokens == 3
    assert "listening on https://127.0.0.1" in server.log()


def test_plain_http_and_an_untrusted_certificate_are_refused(server):
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=5)  # the system's CAs do not know it
    assert httpx.get(server.url + "/health", verify=False, timeout=5).status_code == 200


def test_a_key_that_does_not_load_is_named_before_the_model_loads(llama_path, tls, tmp_path):
    _, cert = tls
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(llama_path), "--port",
                        str(free_port()), "--ssl-keyfile", str(bad), "--ssl-certfile", str(cert)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "do not load as a PEM certificate and its private key" in r.stderr, r.stderr
    assert "KV cache" not in r.stderr  # refused before the engine was built
