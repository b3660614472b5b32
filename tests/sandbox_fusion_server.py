"""A small SandboxFusion-compatible service for tests: POST /run_code runs Python in our sandbox.

    python tests/sandbox_fusion_server.py     # prints `port N` once it listens on 127.0.0.1:N

It answers the subset of SandboxFusion's /run_code that code_reward's client sends and reads:
request {code, stdin, language, run_timeout, memory_limit_MB, ...}; reply {status: Success | Failed |
SandboxError, message, compile_result: null, run_result: {status: Finished | TimeLimitExceeded | Error,
return_code, stdout, stderr, execution_time}}. A language other than python is a SandboxError.

Broken services, for the client's error paths: POST /list answers a JSON list, /run_list a run_result
that is a list, /int_stdout a stdout that is a number, /flaky502 a 502 the first time, then /run_code.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sandbox import run_python_sandboxed  # noqa: E402


def run_code(request: dict) -> dict:
    if request.get("language") != "python":
        return {"status": "SandboxError", "message": f"language {request.get('language')!r} is not served here",
                "compile_result": None, "run_result": None}
    timeout = float(request.get("run_timeout") or 10)
    result = run_python_sandboxed(request["code"], timeout_s=timeout, cpu_s=max(1, round(timeout)),
                                  memory_mb=int(request.get("memory_limit_MB") or 1024), stdin=request.get("stdin") or "",
                                  max_output_chars=1 << 20)
    status = "TimeLimitExceeded" if result.timed_out else "Finished" if result.exit_code >= 0 else "Error"
    run = {"status": status, "return_code": result.exit_code, "stdout": result.stdout,
           "stderr": result.text[len(result.stdout):], "execution_time": result.wall_s}
    ok = status == "Finished" and result.exit_code == 0
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "run_result": run}


SEEN: set[str] = set()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path not in ("/run_code", "/list", "/run_list", "/int_stdout", "/flaky502"):
            self.send_error(404)
            return
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flaky502" and "flaky502" not in SEEN:
            SEEN.add("flaky502")
            self.send_error(502)
            return
        answer = run_code(request)
        if self.path == "/list":
            answer = [answer]
        elif self.path == "/run_list":
            answer["run_result"] = [answer["run_result"]]
        elif self.path == "/int_stdout":
            answer["run_result"]["stdout"] = 3
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # quiet
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()
