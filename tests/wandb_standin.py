"""A stand-in for the wandb server, for the one thing this machine cannot reach it for: a
sweep. It answers the GraphQL calls the wandb client makes in `wandb.sweep` (query Viewer,
mutation UpsertSweep) and, for a bayes sweep, those of wandb's agent protocol (mutation
CreateAgent, then mutation Heartbeat, whose answer hands the agent a run: its id and the
values of the sweep's parameters), and records every request as one JSON line in REQUESTS
(a heartbeat's line also holds the commands it answered). Any other request gets an empty
answer.

    python tests/wandb_standin.py REQUESTS SWEEP_ID          # prints its port, then serves
    python tests/wandb_standin.py REQUESTS SWEEP_ID RUNS     # bayes: hands out RUNS runs

Without RUNS it exits once it has registered one sweep, so later wandb runs find no server
and log offline, as on a compute node without a route out. With RUNS it serves until it is
killed: run i (0, 1, ...) gets, for each parameter, values[i % len], value, or the point
(i + 1) / (RUNS + 1) of the way from min to max (an integer where min and max are); heartbeats
after the RUNS-th run are answered with no command, as a finished sweep's are.

With SWEEP_ID `-` it stands in for a server that refuses the API key: every GraphQL call is
answered 401, as wandb answers a wrong key, until it is killed (a client may ask again, as
pyrecover does to tell a refused key from a failing server).
"""

from __future__ import annotations

import http.server
import json
import sys
import threading

import yaml


def pick(params: dict, i: int, runs: int) -> dict:
    """pick is run i's args, as a heartbeat's run command carries them: {key: {value: v}}."""
    args = {}
    for key, p in params.items():
        if "values" in p:
            value = p["values"][i % len(p["values"])]
        elif "value" in p:
            value = p["value"]
        else:
            low, high = float(p["min"]), float(p["max"])
            value = low + (high - low) * (i + 1) / (runs + 1)
            if isinstance(p["min"], int) and isinstance(p["max"], int):
                value = round(value)
        args[key] = {"value": value}
    return args


def main(requests_path: str, sweep_id: str, runs: int | None) -> None:
    done = threading.Event()
    lock = threading.Lock()
    handed: list[str] = []
    sweep: dict = {}

    def answer(query: str, variables: dict) -> dict:
        if "upsertSweep" in query:
            sweep.update(yaml.safe_load(variables["config"]))
            project = variables.get("projectName") or "uncategorized"
            return {"upsertSweep": {"configValidationWarnings": [], "sweep": {
                "name": sweep_id, "project": {"id": "p1", "name": project,
                                              "entity": {"id": "e1", "name": "standin"}}}}}
        if "createAgent" in query:
            return {"createAgent": {"agent": {"id": f"agent-{variables['host']}"}}}
        if "agentHeartbeat" in query:
            commands = []
            if runs is not None and len(handed) < runs:
                handed.append(f"standinrun{len(handed)}")
                commands = [{"type": "run", "run_id": handed[-1],
                             "args": pick(sweep.get("parameters", {}), len(handed) - 1, runs)}]
            return {"agentHeartbeat": {"agent": {"id": variables["id"]},
                                       "commands": json.dumps(commands)}}
        if "viewer" in query:
            return {"viewer": {"id": "v1", "entity": "standin", "username": "standin",
                               "flags": "{}", "teams": {"edges": []}}}
        return {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                request = json.loads(body)
            except ValueError:
                request = {}
            query = request.get("query", "") if isinstance(request, dict) else ""
            variables = (request.get("variables") or {}) if query else None
            status, payload = 200, {}
            with lock:
                if sweep_id == "-":
                    status, payload = 401, {"errors": [{"message": "user is not logged in"}]}
                elif query:
                    payload = {"data": answer(query, variables or {})}
                else:
                    payload = {"data": {}}
                line = {"path": self.path, "query": query, "variables": variables}
                if "agentHeartbeat" in query:
                    line["commands"] = json.loads(payload["data"]["agentHeartbeat"]["commands"])
                with open(requests_path, "a") as f:
                    f.write(json.dumps(line) + "\n")
            out = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            if "upsertSweep" in query and runs is None and sweep_id != "-":
                done.set()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    done.wait(timeout=600 if runs is None else 1800)  # bounded: never outlives its test
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
