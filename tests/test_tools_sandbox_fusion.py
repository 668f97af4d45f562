"""The SandboxFusion client against a local stand-in service that runs the posted code in the real bubblewrap
sandbox and answers in SandboxFusion's shape: success, errors, time-outs, state, and an unreachable service."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stare_lightning.tools import build_tool
from stare_lightning.tools.python_sandbox import PythonSandbox

pytestmark = pytest.mark.needs("bwrap")


def _stand_in(received: list[dict]):
    """A handler class answering POST /run_code as SandboxFusion does, executing with the local sandbox."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            if self.path != "/run_code":
                self.send_error(404)
                return
            # The posted code already holds the replay: run it as a fresh, state-less call.
            sandbox = PythonSandbox(persist_state=False, timeout_seconds=body["run_timeout"], max_output_chars=4000)
            result = sandbox.run(body["code"])
            status = "TimeLimitExceeded" if result.timed_out else "Finished"
            answer = {
                "status": "Success" if result.ok else "Failed",
                "message": "",
                "run_result": {"status": status, "stdout": result.text, "stderr": "",
                               "return_code": 0 if result.ok else 1, "execution_time": result.seconds},
            }  # fmt: skip
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture(scope="module")
def service():
    received: list[dict] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _stand_in(received))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def _client(url, **options):
    return build_tool("python", isolation="sandbox_fusion", sandbox_fusion_url=url, **options)


def test_calls_run_on_the_service_with_state_and_errors(service):
    url, received = service
    tool = _client(url, timeout_seconds=3.0)
    assert tool.run("print(6 * 7)").text.strip() == "42"
    sent = received[-1]
    assert sent["language"] == "python" and sent["run_timeout"] == 3.0 and "print(6 * 7)" in sent["code"]
    kept = tool.run("print(x + 1)", history=["x = 41"])
    assert kept.ok and kept.text.strip() == "42"
    failed = tool.run("1 / 0")
    assert not failed.ok and "ZeroDivisionError" in failed.text


def test_a_time_out_on_the_service_is_a_timed_out_result(service):
    url, _ = service
    result = _client(url, timeout_seconds=1.0).run("while True:\n    pass")
    assert not result.ok and result.timed_out and "TimeoutError" in result.text


def test_an_unreachable_service_is_an_error_result_not_an_exception():
    result = _client("http://127.0.0.1:9", timeout_seconds=0.5).run("print(1)")
    assert not result.ok and "could not be reached" in result.text


def test_a_service_answering_404_is_an_error_result(service):
    url, _ = service
    result = _client(url + "/wrong/prefix", timeout_seconds=1.0).run("print(1)")
    assert not result.ok and "HTTP 404" in result.text
