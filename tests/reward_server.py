"""A scorer service for the tests of reward_remote.py: a real HTTP server process, one behaviour per path.

    python tests/reward_server.py [--log FILE]     prints its port on the first line, then serves

POST /ok           {"scores": 1.0 if the response's last `#### N` is the ground truth else 0.0,
                    "extras": [{"length": len(response)}]}; with --log, one JSON line per item scored
POST /slow         /ok after 3 s
POST /slow_ok      /ok after 0.4 s (concurrency: N requests take about 0.4 s, not N x 0.4 s)
POST /flaky        500 the first time a request body is seen, then /ok
POST /malformed    a body that is not JSON
POST /wrong_count  one score fewer than items
POST /nan          NaN (as Python's json writes it) for the second item
POST /nan_once     NaN for the first item of the first request, then /ok
POST /bad_extras   an extra that is a string
POST /status404    404
POST /auth         /ok with `Authorization: Bearer secret-token`, else 401
POST /drip         a valid answer's headers, then its body one byte every 0.2 s
POST /huge         a 17 MiB body (a JSON string)
POST /chat/v1/chat/completions   an OpenAI chat completion: "Score: <characters of the user message mod 10>"
POST /chat<N>/v1/chat/completions   a chat completion replying "Score: <N>" (N digits: 1000, 400 nines, ...)
"""

import argparse
import hashlib
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEEN: set[str] = set()
LOCK = threading.Lock()


ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def score(item: dict) -> float:
    """The demo task's rule: the last `#### N` of the last 300 characters is the ground truth."""
    found = ANSWER.findall(item["response"][-300:])
    return float(bool(found) and found[-1].replace(",", "") == str(item["ground_truth"]))


class Handler(BaseHTTPRequestHandler):
    log_file = None

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        path = self.path
        if path.startswith("/chat") and path.endswith("/v1/chat/completions"):
            fixed = path[len("/chat"):-len("/v1/chat/completions")]
            content = body["messages"][-1]["content"]
            answer = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                           "content": f"Score: {fixed or len(content) % 10}"}}]}
            return self.reply(200, json.dumps(answer).encode())
        items = body["items"]
        if path == "/auth" and self.headers.get("Authorization") != "Bearer secret-token":
            return self.reply(401, b'{"error": "unauthorized"}')
        if path == "/huge":
            return self.reply(200, json.dumps("x" * (17 * 2**20)).encode())
        if path == "/drip":
            answer = json.dumps({"scores": [0.0] * len(items)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            for byte in answer:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
            return None
        if path == "/status404":
            return self.reply(404, b'{"error": "no such scorer"}')
        if path == "/malformed":
            return self.reply(200, b'{"scores": [1.0, ')
        if path == "/flaky":
            digest = hashlib.sha256(raw).hexdigest()
            with LOCK:
                first = digest not in SEEN
                SEEN.add(digest)
            if first:
                return self.reply(500, b'{"error": "warming up"}')
        if path == "/slow":
            time.sleep(3.0)
        if path == "/slow_ok":
            time.sleep(0.4)
        scores = [score(item) for item in items]
        extras = [{"length": len(item["response"])} for item in items]
        if path == "/wrong_count":
            scores = scores[:-1]
        if path == "/nan":
            scores[1] = float("nan")
        if path == "/nan_once":  # the first request only: one rank of a job fails
            with LOCK:
                first = "nan_once" not in SEEN
                SEEN.add("nan_once")
            if first:
                scores[0] = float("nan")
        if path == "/bad_extras":
            extras[0] = {"length": "long"}
        if self.log_file is not None:
            with LOCK, open(self.log_file, "a") as f:
                for item, s in zip(items, scores, strict=False):
                    f.write(json.dumps({"path": path, "response": item["response"], "score": s,
                                        "extra_info": item["extra_info"]}) + "\n")
        self.reply(200, json.dumps({"scores": scores, "extras": extras}).encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log")
    args = parser.parse_args()
    Handler.log_file = args.log
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # a free port, never a fixed one
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
