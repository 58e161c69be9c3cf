"""A stand-in for the wandb server, for the one thing this machine cannot reach it for: a
sweep's registration. It answers only the two GraphQL calls the wandb client makes in
`wandb.sweep` (query Viewer, mutation UpsertSweep), records every request as one JSON line in
REQUESTS, and exits once it has registered one sweep, so later wandb runs find no server and
log offline, as on a compute node without a route out. Any other request gets an empty answer.

    python tests/wandb_standin.py REQUESTS SWEEP_ID    # prints its port, then serves

With SWEEP_ID `-` it stands in for a server that refuses the API key: every GraphQL call is
answered 401, as wandb answers a wrong key, and it exits after the first refusal.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading


def main(requests_path: str, sweep_id: str) -> None:
    registered = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                request = json.loads(body)
            except ValueError:
                request = {}
            query = request.get("query", "") if isinstance(request, dict) else ""
            with open(requests_path, "a") as f:
                f.write(json.dumps({"path": self.path, "query": query,
                                    "variables": request.get("variables") if query else None})
                        + "\n")
            data: dict = {}
            if sweep_id == "-":
                out = json.dumps({"errors": [{"message": "user is not logged in"}]}).encode()
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                registered.set()
                return
            if "upsertSweep" in query:
                project = request["variables"].get("projectName") or "uncategorized"
                data = {"upsertSweep": {"configValidationWarnings": [], "sweep": {
                    "name": sweep_id, "project": {"id": "p1", "name": project,
                                                  "entity": {"id": "e1", "name": "standin"}}}}}
            elif "viewer" in query:
                data = {"viewer": {"id": "v1", "entity": "standin", "username": "standin",
                                   "flags": "{}", "teams": {"edges": []}}}
            out = json.dumps({"data": data}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            if "upsertSweep" in query:
                registered.set()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registered.wait(timeout=600)  # bounded: never outlives its test
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
