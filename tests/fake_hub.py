"""A Hugging Face hub on 127.0.0.1 that speaks the five requests an upload makes (huggingface_hub 2.x: whoami-v2,
repos/create, validate-yaml, preupload, commit), keeps each repo's commits in memory, and answers every file as a
"regular" upload (base64 in the commit's ndjson; no LFS or Xet storage to imitate). Nothing leaves the machine.

    with FakeHub(token="hf_test") as hub:   # hub.url for HF_ENDPOINT / constants.ENDPOINT
        ...
        hub.repos["me/x"]  # {"private": ..., "commits": [{"message": ..., "files": {path: bytes}}]}
"""

from __future__ import annotations

import base64, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, token: str = "hf_test", user: str = "tester", role: str = "write"):
        self.token, self.user, self.role, self.repos, self.requests = token, user, role, {}, []
        self.forbidden = False  # True: creating a repo is refused (403), as for an owner the token may not write to

    def __enter__(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {hub.token}":
                    return True
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                if not self._authorised():
                    return
                if self.path.startswith("/api/whoami-v2"):
                    return self._send(
                        200, {"type": "user", "name": hub.user, "auth": {"accessToken": {"role": hub.role}}}
                    )
                self._send(404, {"error": "not found"})

            def do_POST(self):
                hub.requests.append(("POST", self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._authorised():
                    return
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    if hub.forbidden:
                        return self._send(
                            403, {"error": "You don't have the rights to create a model under this namespace"}
                        )
                    d = json.loads(body)
                    rid = f"{d.get('organization') or hub.user}/{d['name']}"
                    if rid in hub.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": rid})
                    hub.repos[rid] = {"private": d.get("visibility") == "private", "commits": []}
                    return self._send(200, {"url": f"http://{self.headers['Host']}/{rid}"})
                if path == "/api/validate-yaml":
                    return self._send(200, {})
                parts = path.split("/")  # /api/models/<owner>/<name>/<preupload|commit>/<revision>
                if len(parts) == 7 and parts[:3] == ["", "api", "models"]:
                    rid = f"{parts[3]}/{parts[4]}"
                    if rid not in hub.repos:
                        return self._send(404, {"error": f"Repository {rid} not found"})
                    if parts[5] == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(
                            200,
                            {
                                "files": [
                                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                    for f in files
                                ]
                            },
                        )
                    if parts[5] == "commit":
                        items = [json.loads(l) for l in body.decode().splitlines() if l.strip()]
                        head = next(i["value"] for i in items if i["key"] == "header")
                        files = {
                            i["value"]["path"]: base64.b64decode(i["value"]["content"])
                            for i in items
                            if i["key"] == "file"
                        }
                        unknown = [i["key"] for i in items if i["key"] not in ("header", "file")]
                        if unknown:
                            return self._send(400, {"error": f"this fake hub takes regular files only: {unknown}"})
                        commits = hub.repos[rid]["commits"]
                        commits.append({"message": head["summary"], "files": files})
                        oid = f"{len(commits):040x}"
                        return self._send(
                            200,
                            {
                                "commitUrl": f"http://{self.headers['Host']}/{rid}/commit/{oid}",
                                "commitOid": oid,
                                "pullRequestUrl": None,
                            },
                        )
                self._send(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
