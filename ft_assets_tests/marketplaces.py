"""RunPod's and Vast.ai's APIs on loopback, for the idle sensor's real SDK calls (as moto stands in for EC2).

One HTTP server answers both, in the shapes their SDKs send and parse (read from runpod 1.12's
``runpod/api`` and vastai 1.9's ``vastai/api``):

- RunPod (``RUNPOD_API_BASE_URL``): ``POST /graphql`` with ``{"query": ...}`` and ``Authorization: Bearer
  <key>`` (401 otherwise). ``myself { pods { ... } }`` answers ``{"data": {"myself": {"pods": [...]}}}``;
  ``podStop(input: {podId: "x"})`` answers ``{"data": {"podStop": {"id", "desiredStatus"}}}`` or, for a pod
  in ``refuse_stop``, ``{"errors": [{"message": ...}]}`` (which the SDK raises as ``QueryError``);
  ``podTerminate`` answers ``{"data": {"podTerminate": null}}``.
- Vast.ai (``VastAI(server_url=...)``): ``GET /api/v1/instances/?select_filters=..&order_by=..&limit=25``
  answers ``{"instances": [...], "next_token": null}`` with ``extra_env`` as ``[[name, value], ...]``;
  ``PUT /api/v0/instances/<id>/`` with ``{"state": "stopped"}`` and ``DELETE /api/v0/instances/<id>/``
  answer ``{"success": true}``.

Every mutation is recorded in ``calls`` as (provider, verb, id), in order.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

RUNPOD_KEY, VAST_KEY = "rp-test-key", "vast-test-key"


class Marketplaces:
    def __init__(self):
        self.pods: list[dict] = []
        self.instances: list[dict] = []
        self.refuse_stop: dict[str, str] = {}  # pod id -> the GraphQL error RunPod answers podStop with
        self.calls: list[tuple[str, str, str]] = []
        self.queries: list[dict] = []  # every Vast.ai list request's query arguments
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                outer._runpod(self)

            def do_GET(self):  # noqa: N802
                outer._vast(self, "GET")

            def do_PUT(self):  # noqa: N802
                outer._vast(self, "PUT")

            def do_DELETE(self):  # noqa: N802
                outer._vast(self, "DELETE")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _reply(handler, status: int, body) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    @staticmethod
    def _body(handler) -> dict:
        length = int(handler.headers.get("Content-Length") or 0)
        return json.loads(handler.rfile.read(length) or b"{}")

    def _runpod(self, handler) -> None:
        if urlsplit(handler.path).path != "/graphql":
            return self._reply(handler, 404, {"error": "not found"})
        if handler.headers.get("Authorization") != f"Bearer {RUNPOD_KEY}":
            return self._reply(handler, 401, {"error": "unauthorized"})
        query = self._body(handler)["query"]
        if "myself" in query and "pods" in query:
            return self._reply(handler, 200, {"data": {"myself": {"pods": self.pods}}})
        mutation = re.search(r"(podStop|podTerminate)\(input:\s*\{\s*podId:\s*\"([^\"]+)\"", query)
        if mutation is None:
            return self._reply(handler, 200, {"errors": [{"message": f"unsupported query: {query[:80]}"}]})
        verb, pod_id = mutation.groups()
        pod = next((p for p in self.pods if p["id"] == pod_id), None)
        if pod is None:
            return self._reply(handler, 200, {"errors": [{"message": f"pod {pod_id} not found"}]})
        if verb == "podStop" and pod_id in self.refuse_stop:
            return self._reply(handler, 200, {"errors": [{"message": self.refuse_stop[pod_id]}], "data": None})
        self.calls.append(("runpod", verb, pod_id))
        if verb == "podStop":
            pod["desiredStatus"] = "EXITED"
            return self._reply(handler, 200, {"data": {"podStop": {"id": pod_id, "desiredStatus": "EXITED"}}})
        pod["desiredStatus"] = "TERMINATED"
        return self._reply(handler, 200, {"data": {"podTerminate": None}})

    def _vast(self, handler, method: str) -> None:
        if handler.headers.get("Authorization") != f"Bearer {VAST_KEY}":
            return self._reply(handler, 401, {"success": False, "error": "invalid api key"})
        url = urlsplit(handler.path)
        if method == "GET" and url.path == "/api/v1/instances/":
            self.queries.append({k: v[0] for k, v in parse_qs(url.query).items()})
            rows = [{**row, "extra_env": [[k, v] for k, v in row["extra_env"].items()]} for row in self.instances]
            return self._reply(handler, 200, {"instances": rows, "next_token": None, "total_instances": len(rows)})
        match = re.fullmatch(r"/api/v0/instances/(\d+)/", url.path)
        instance = next((i for i in self.instances if match and str(i["id"]) == match.group(1)), None)
        if instance is None:
            return self._reply(handler, 404, {"success": False, "error": "no such instance"})
        if method == "PUT":
            state = self._body(handler).get("state")
            self.calls.append(("vast", f"state={state}", str(instance["id"])))
            instance["actual_status"] = instance["intended_status"] = state
            return self._reply(handler, 200, {"success": True})
        if method == "DELETE":
            self.calls.append(("vast", "destroy", str(instance["id"])))
            self.instances.remove(instance)
            return self._reply(handler, 200, {"success": True})
        return self._reply(handler, 405, {"success": False})
